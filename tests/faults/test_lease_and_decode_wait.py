"""Waiting is not failing, on a real cluster (tiny model, one prefill and one decode node, both
with a small KV cache and a 0.75 s lease; the prefill node computes one prompt token per step, so
its queue grows long). A prefill queue several lease periods long fails no request: the prefill
node renews the decode node's reservations while the prompts wait (the old fixed 30 s wait for
pages failed them). A burst of twice what the decode pool holds gets only 200s: the requests
that find the pool full wait for blocks instead of a 429. Afterwards every node reports no
pending transfer and all its blocks free."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pdserve.launcher import Launcher
from tests.e2e.helpers import e2e_plan
from tests.factories import build_tiny_chat_model
from tests.faults.helpers import wait_until_nodes_idle

pytestmark = pytest.mark.timeout(300)

LEASE_S = 0.75
PROMPT_TOKENS = 450  # 29 blocks of 16 tokens, output included
MAX_TOKENS = 8
POOL_REQUESTS = 16  # what the decode pool holds: 16 x 29 blocks
KV_CACHE_GIB = 464 * 8192 / 2**30  # 464 blocks of the tiny model's 8 KiB (2 layers, K and V, 2 heads of 16)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    node_args = ("--kv-cache-gib", str(KV_CACHE_GIB), "--kv-lease-s", str(LEASE_S), "--max-reserve-wait-s", "60")
    plan = e2e_plan(
        model,
        tmp_path_factory.mktemp("logs"),
        node_args=node_args,
        prefill_args=("--max-num-batched-tokens", "1"),  # a slow prefill node: a long queue
    )
    with Launcher(plan) as running:
        yield running


async def time_to_first_token(client: httpx.AsyncClient, model: str, i: int) -> tuple[int, float]:
    """(status, seconds to the first token) of a streamed completion of prompt i (token ids no
    other prompt shares, so no prefix cache shortens it)."""
    prompt = list(range(1000 + 500 * i, 1000 + 500 * i + PROMPT_TOKENS))
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    start, first = time.monotonic(), None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - start
    return response.status_code, first if first is not None else float("inf")


def burst(cluster: Launcher, num_requests: int, first_index: int) -> list[tuple[int, float]]:
    async def main():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            indices = range(first_index, first_index + num_requests)
            return await asyncio.gather(*(time_to_first_token(client, model, i) for i in indices))

    return asyncio.run(main())


def test_a_prefill_queue_several_leases_long_fails_no_request(cluster):
    results = burst(cluster, POOL_REQUESTS, first_index=0)  # all reserved at once: only the prefill queue waits
    assert [status for status, _ in results] == [200] * POOL_REQUESTS
    # The last prompts' reservations waited for their pages through several lease periods
    # (here about 4; a fixed wait of one lease period would have failed half the requests).
    assert max(ttft for _, ttft in results) > 2 * LEASE_S
    wait_until_nodes_idle(cluster, num_nodes=2)


def test_a_burst_of_twice_the_decode_pool_waits_for_blocks_instead_of_429(cluster):
    results = burst(cluster, 2 * POOL_REQUESTS, first_index=POOL_REQUESTS)
    assert [status for status, _ in results] == [200] * 2 * POOL_REQUESTS
    wait_until_nodes_idle(cluster, num_nodes=2)
