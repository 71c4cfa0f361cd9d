"""A burst of about 4x what the cluster admits: only 200s and 429s with Retry-After, every 200
complete, and nothing left counted or reserved afterwards (gateway admission and in-flight
gauges, nodes' pending transfers and free blocks in the registry), with the gateway's memory
bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Launcher
from tests.e2e.helpers import e2e_plan, metric_samples, wait_until
from tests.factories import build_tiny_chat_model
from tests.faults.helpers import wait_until_nodes_idle

pytestmark = pytest.mark.timeout(300)

STREAMS_PER_DECODE_NODE = 4
BURST = 4 * STREAMS_PER_DECODE_NODE * 2  # two decode nodes
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    gateway_args = ("--admission-streams-per-decode-node", str(STREAMS_PER_DECODE_NODE))
    plan = e2e_plan(model, tmp_path_factory.mktemp("logs"), num_decode=2, gateway_args=gateway_args)
    with Launcher(plan) as running:
        yield running


async def completion(client: httpx.AsyncClient, model: str, i: int) -> httpx.Response:
    body = {"model": model, "prompt": f"Request {i}: tell me about the sea.", "max_tokens": MAX_TOKENS}
    body |= {"ignore_eos": True, "temperature": 0}
    return await client.post("/v1/completions", json=body)


def rss_kib(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0])


def test_a_burst_gets_200s_and_429s_only_and_leaks_nothing(cluster):
    gateway_pid = cluster.child("gateway").process.pid
    rss_before = rss_kib(gateway_pid)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            return await asyncio.gather(*(completion(client, model, i) for i in range(BURST)))

    responses = asyncio.run(burst())
    statuses = sorted({r.status_code for r in responses})
    assert set(statuses) <= {200, 429}, [r.text for r in responses if r.status_code not in (200, 429)]
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert accepted and refused, statuses
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in accepted)
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in refused)
    assert rss_kib(gateway_pid) - rss_before < 100 * 1024  # KiB: the refused ones held nothing

    def drained() -> bool:
        admitted = {
            labels["phase"]: value for labels, value in metric_samples(cluster.base_url, "pdserve_gateway_admitted")
        }
        in_flight = [value for _, value in metric_samples(cluster.base_url, "pdserve_gateway_in_flight_requests")]
        return admitted == {"prefill_tokens": 0, "decode_streams": 0} and not any(in_flight)

    wait_until(drained, 10, "the gateway's admission and in-flight counts to return to 0")

    wait_until_nodes_idle(cluster, num_nodes=3)
