"""Prefix-aware routing through real processes: embedded Redis, 2 prefill nodes, 1 decode node
and the gateway (default policy prefix_aware), on a tiny model with the real tokenizer."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import redis

from gateway.tokenizer import Tokenizer
from pdserve.cluster_state.registry import NodeInfo, node_key
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from tests.e2e.processes import metric_samples, routed_counts, running_cluster, wait_until
from tests.factories import build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are a careful assistant for a library. " * 16  # ~150 tokens: several full blocks
MAX_TOKENS = 16


def registered(redis_url: str, node_id: str) -> NodeInfo | None:
    value = redis.Redis.from_url(redis_url).get(node_key(node_id))
    return NodeInfo.from_json(value) if value else None


def kv_index_keys(redis_url: str, node_id: str) -> list[bytes]:
    return list(redis.Redis.from_url(redis_url).scan_iter(f"pdserve:kv:{node_id}:*"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    # Prefill steps of 32 tokens: a burst of cache hits soon queues more than one step,
    # the point where the load cap starts to move prompts (gateway/router.py).
    step = ("--max-num-batched-tokens", "32")
    nodes = [("prefill", "prefill-0", *step), ("prefill", "prefill-1", *step), ("decode", "decode-0")]
    with running_cluster(model, tmp_path_factory.mktemp("logs"), nodes) as running:
        yield running


def parse_route(header: str) -> dict[str, str]:
    return dict(part.strip().split("=", 1) for part in header.split(";"))


async def chat(base_url: str, model: str, messages: list[dict]) -> tuple[str, dict[str, str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(
            f"{base_url}/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"], parse_route(response.headers["x-pdserve-route"])


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_requests_sharing_a_system_prompt_land_on_the_node_that_cached_it(cluster):
    async def body():
        _, first = await chat(cluster["base_url"], cluster["model"], ask("What opens at nine?"))
        await asyncio.sleep(0.5)  # nodes publish their cache changes every 0.1 s
        routes = [(await chat(cluster["base_url"], cluster["model"], ask(f"Where is shelf {i}?")))[1] for i in range(4)]
        return first, routes

    first, routes = asyncio.run(body())
    assert int(first["cached_tokens"]) == 0
    assert {r["prefill"] for r in routes} == {first["prefill"]}
    assert all(int(r["cached_tokens"]) >= 128 for r in routes)  # the system prompt's full blocks


async def chats_in_parallel(cluster, questions: list[str]) -> list[tuple[str, dict[str, str]]]:
    return await asyncio.gather(
        *(chat(cluster["base_url"], cluster["model"], [{"role": "user", "content": q}]) for q in questions)
    )


def in_flight(base_url: str) -> float:
    """Requests the gateway's router still counts against some node."""
    return sum(value for _, value in metric_samples(base_url, "pdserve_gateway_in_flight_requests"))


def load_cap_decisions(base_url: str) -> float:
    samples = metric_samples(base_url, "pdserve_gateway_routing_decisions_total", role="prefill", reason="load_cap")
    return sum(value for _, value in samples)


def test_a_burst_on_one_prefix_is_spread_by_the_load_cap(cluster):
    async def body():
        await chat(cluster["base_url"], cluster["model"], ask("Warm the cache."))
        await asyncio.sleep(0.5)
        replies = await asyncio.gather(
            *(chat(cluster["base_url"], cluster["model"], ask(f"Burst {i}?")) for i in range(24))
        )
        return [route for _, route in replies]

    capped_before = load_cap_decisions(cluster["base_url"])
    routes = asyncio.run(body())
    assert {r["prefill"] for r in routes} == {"prefill-0", "prefill-1"}
    assert load_cap_decisions(cluster["base_url"]) > capped_before  # moved by the cap, not by cost
    assert in_flight(cluster["base_url"]) == 0


def test_second_chat_turn_moves_only_new_blocks_and_matches_the_offline_engine(cluster):
    model, redis_url = cluster["model"], cluster["redis_url"]
    turn_1 = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm " * 6}]

    async def body():
        reply_1, _ = await chat(cluster["base_url"], model, turn_1)
        await asyncio.sleep(1.5)  # one heartbeat carries the decode node's counters
        blocks_before = registered(redis_url, "decode-0").stats.kv_blocks_received
        turn_2 = turn_1 + [{"role": "assistant", "content": reply_1}, {"role": "user", "content": "And then?"}]
        reply_2, route = await chat(cluster["base_url"], model, turn_2)
        await asyncio.sleep(1.5)
        return turn_2, reply_2, route, registered(redis_url, "decode-0").stats.kv_blocks_received - blocks_before

    turn_2, reply_2, route, blocks_moved = asyncio.run(body())
    tokenizer = Tokenizer.from_folder(model)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(turn_2), add_special_tokens=False)
    num_prompt_blocks = -(-len(prompt) // 16)
    assert int(route["decode_cached_tokens"]) >= 64  # turn 1's prompt blocks stayed on the decode node
    assert blocks_moved == num_prompt_blocks - int(route["decode_cached_tokens"]) // 16
    offline = LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_blocks=64)))
    expected = offline.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].token_ids
    assert reply_2 == tokenizer.decode(expected)


def test_a_killed_prefill_nodes_entries_expire_and_its_restart_does_not_inherit_them(cluster):
    group, redis_url = cluster["group"], cluster["redis_url"]
    asyncio.run(chat(cluster["base_url"], cluster["model"], ask("Fill both caches.")))
    old = registered(redis_url, "prefill-1")
    wait_until(lambda: kv_index_keys(redis_url, "prefill-1"), 10, "prefill-1 to publish its cache")
    group.stop("prefill-1", signal.SIGKILL)
    started = time.monotonic()
    # Still registered: distinct prompts spread over both nodes by queued work, so some first
    # go to the dead node, fail to connect and are retried on the other.
    tried_before = routed_counts(cluster["base_url"], "prefill").get("prefill-1", 0)
    replies = asyncio.run(
        chats_in_parallel(cluster, [f"Question {i}: " + "why is the sky blue " * 20 for i in range(6)])
    )
    assert routed_counts(cluster["base_url"], "prefill").get("prefill-1", 0) > tried_before
    assert all(route["prefill"] == "prefill-0" for _, route in replies)
    assert in_flight(cluster["base_url"]) == 0  # the failed attempts released their nodes too
    wait_until(lambda: not kv_index_keys(redis_url, "prefill-1"), 10, "prefill-1's KV index entries to expire")
    assert time.monotonic() - started <= 3.0 + 1.0  # the registry TTL, plus polling slack
    group.start_node("prefill", "prefill-1", cluster["model"], redis_url)
    wait_until(
        lambda: (info := registered(redis_url, "prefill-1")) and info.incarnation != old.incarnation, 120, "the restart"
    )
    assert not redis.Redis.from_url(redis_url).exists(f"pdserve:kv:prefill-1:{old.incarnation}")
    for key in kv_index_keys(redis_url, "prefill-1"):
        assert redis.Redis.from_url(redis_url).scard(key) == 0  # a fresh node caches nothing yet
