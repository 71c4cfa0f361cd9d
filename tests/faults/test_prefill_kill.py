"""SIGKILL of one of two prefill nodes under load, with one decode node: no client sees a
failure (requests whose prefill was on the dead node are retried on the other before any token
went back), and nothing stays counted or reserved afterwards."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from pdserve.launcher import Launcher
from tests.e2e.helpers import e2e_plan, metric_samples, wait_until
from tests.factories import build_tiny_chat_model
from tests.faults.helpers import wait_until_drained

pytestmark = pytest.mark.timeout(300)

NUM_IN_FLIGHT = 24
# Bounds the load: new requests start only until the kill, and never more than this.
MAX_REQUESTS = 240
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    # 16-token prefill chunks: a burst of long prompts keeps both prefill nodes busy for a while.
    prefill_args = ("--max-num-batched-tokens", "16")
    plan = e2e_plan(model, tmp_path_factory.mktemp("logs"), num_prefill=2, num_decode=1, prefill_args=prefill_args)
    with Launcher(plan) as running:
        yield running


async def completion(client: httpx.AsyncClient, model: str, i: int) -> httpx.Response:
    # Long prompts keep the prefill nodes busy, so the kill lands on queued and running prefills.
    prompt = f"Request {i}: " + "tell me about the sea and the ships on it. " * 20
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    return await client.post("/v1/completions", json=body)


def busy_prefill_nodes(base_url: str) -> list[str]:
    """The prefill nodes the gateway has sent prompts whose prefill has not returned."""
    samples = metric_samples(base_url, "pdserve_gateway_queued_prompt_tokens")
    return [labels["node_id"] for labels, value in samples if value > 0]


def freeze_a_busy_prefill_node(cluster) -> str:
    """SIGSTOPs a prefill node that still owes the gateway prefills, and returns its id.

    Checked again after the stop: between one read of the gateway's metrics and a kill, a
    node can finish its last prefill (CI once killed a node that no longer held any, and no
    request was retried). Frozen, it cannot; a reply already on the wire reaches the gateway
    within the pause, which is checked twice because a loaded gateway may read it late.
    """
    for _ in range(20):
        victim = wait_until(lambda: busy_prefill_nodes(cluster.base_url), 30, "a prefill node with prompts")[0]
        cluster.send_signal(victim, signal.SIGSTOP)
        if stays_busy(cluster, victim):
            return victim
        cluster.send_signal(victim, signal.SIGCONT)
    raise AssertionError("no prefill node stayed busy while frozen")


def stays_busy(cluster, node_id: str, num_checks: int = 2, interval_s: float = 0.5) -> bool:
    for _ in range(num_checks):
        time.sleep(interval_s)
        if node_id not in busy_prefill_nodes(cluster.base_url):
            return False
    return True


async def keep_prefill_nodes_busy(client: httpx.AsyncClient, model: str, killed: asyncio.Event) -> list[httpx.Response]:
    """Keeps NUM_IN_FLIGHT requests going until the kill, then waits for them all.

    A single burst drained in about a second on a fast CI machine, so a freeze that missed
    once found no busy prefill node left to try again on.
    """
    requests: list[asyncio.Task] = []
    while not killed.is_set() and len(requests) < MAX_REQUESTS:
        if sum(not task.done() for task in requests) < NUM_IN_FLIGHT:
            requests.append(asyncio.create_task(completion(client, model, len(requests))))
        else:
            await asyncio.sleep(0.01)
    return await asyncio.gather(*requests)


def test_killing_a_prefill_node_under_load_fails_no_request(cluster):
    async def load_then_kill() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            killed = asyncio.Event()
            load = asyncio.create_task(keep_prefill_nodes_busy(client, model, killed))
            victim = await asyncio.to_thread(freeze_a_busy_prefill_node, cluster)
            cluster.send_signal(victim, signal.SIGKILL)
            killed.set()
            return victim, await load

    victim, responses = asyncio.run(load_then_kill())
    failures = [r.text for r in responses if r.status_code != 200]
    assert failures == [], gateway_log(cluster)
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)
    assert cluster.child(victim).process.wait(timeout=10) == -signal.SIGKILL
    retried = metric_samples(cluster.base_url, "pdserve_gateway_retries_total", node_id=victim)
    # Its prefills went elsewhere.
    assert retried and retried[0][1] >= 1, f"no retry counted against {victim}\n{gateway_log(cluster)}"

    wait_until_drained(cluster, num_nodes=2, dead_node=victim)


def gateway_log(cluster, num_lines: int = 40) -> str:
    """The end of the gateway's log, which names every retry and failure, for an assertion's message."""
    return "gateway log:\n" + "\n".join(cluster.log("gateway").splitlines()[-num_lines:])
