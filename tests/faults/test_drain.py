"""SIGTERM to a decode node while streams run on it (what `docker compose up --scale decode=N-1`
and a rolling restart do): the node is marked draining in the registry at once (routers skip it),
keeps serving its open streams until they finish (--drain-s), and exits 0. No stream fails or
moves to the other node, and requests sent during the drain go to the other node."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from pdserve.launcher import Launcher
from tests.e2e.helpers import e2e_plan, metric_samples
from tests.faults.helpers import wait_until_drained

pytestmark = pytest.mark.timeout(300)

NUM_STREAMS = 4
# The real model, one thread per node: ~50 ms a step, so the streams outlive the server's own 2 s
# stop grace by seconds: without the drain they would be cut and resumed on the other node.
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    plan = e2e_plan(
        "smollm2-135m",
        tmp_path_factory.mktemp("logs"),
        num_decode=2,
        gateway_args=("--router-policy", "least_load"),
        node_args=("--drain-s", "60"),
    )
    with Launcher(plan, stop_grace_s=70) as running:
        yield running


async def stream_chat(client: httpx.AsyncClient, i: int, on_route) -> dict:
    body = {
        "messages": [{"role": "user", "content": f"Story {i}: tell me about the number {i * 7}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = {"decode": "", "finish_reason": None, "completion_tokens": 0, "finished_at": 0.0}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        route = dict(part.split("=", 1) for part in response.headers["x-pdserve-route"].split("; "))
        result["decode"] = route["decode"]
        on_route(route["decode"])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            result["completion_tokens"] = (event.get("usage") or {}).get("completion_tokens", 0) or result[
                "completion_tokens"
            ]
            for choice in event["choices"]:
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
    result["finished_at"] = time.monotonic()
    return result


def test_sigterm_drains_a_decode_node_without_failing_or_moving_its_streams(cluster):
    terminated: dict = {}

    async def scenario() -> list[dict]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
            routes: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.create_task(stream_chat(client, i, routes.put_nowait)) for i in range(NUM_STREAMS)]
            first_decode = await asyncio.wait_for(routes.get(), 120)
            await asyncio.sleep(0.5)  # its stream is generating
            cluster.send_signal(first_decode, signal.SIGTERM)
            terminated.update(node=first_decode, at=time.monotonic())
            while (await client.get("/health")).json().get("num_nodes", {}).get("decode") != 1:
                assert time.monotonic() < terminated["at"] + 10, "the node did not leave the registry"
                await asyncio.sleep(0.1)
            # Sent during the drain: it must go to the node that stays.
            during = await stream_chat(client, NUM_STREAMS, lambda route: None)
            return [*await asyncio.gather(*tasks), during]

    results = asyncio.run(scenario())
    node = terminated["node"]

    on_node = [r for r in results[:NUM_STREAMS] if r["decode"] == node]
    assert on_node and all(r["finished_at"] > terminated["at"] + 2 for r in on_node), "ended before the drain mattered"
    assert [r["finish_reason"] for r in results] == ["length"] * (NUM_STREAMS + 1)
    assert [r["completion_tokens"] for r in results] == [MAX_TOKENS] * (NUM_STREAMS + 1)
    assert results[-1]["decode"] != node
    assert cluster.child(node).process.wait(timeout=90) == 0
    migrations = metric_samples(cluster.base_url, "pdserve_gateway_migrations_total")
    assert sum(value for _, value in migrations) == 0, migrations
    wait_until_drained(cluster, num_nodes=2, dead_node=node)
