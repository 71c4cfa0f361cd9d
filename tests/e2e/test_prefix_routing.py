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
from pdserve.cluster_state.kv_index import kv_index_key
from pdserve.cluster_state.registry import NodeInfo, node_key
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.block_hash import hash_token_blocks
from pdserve.launcher import Launcher
from tests.e2e.helpers import e2e_plan, metric_samples, routed_counts, wait_until
from tests.factories import build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are a careful assistant for a library. " * 16  # ~150 tokens: several full blocks
MAX_TOKENS = 16
BLOCK_SIZE = 16


def registered(redis_url: str, node_id: str) -> NodeInfo | None:
    value = redis.Redis.from_url(redis_url).get(node_key(node_id))
    return NodeInfo.from_json(value) if value else None


def kv_index_keys(redis_url: str, node_id: str) -> list[bytes]:
    return list(redis.Redis.from_url(redis_url).scan_iter(f"pdserve:kv:{node_id}:*"))


def indexed_blocks(redis_url: str, node_id: str, token_ids: list[int]) -> int:
    """How many of the prompt's leading full blocks the node's KV index in Redis lists."""
    info = registered(redis_url, node_id)
    hashes = hash_token_blocks(token_ids, info.capacity.block_size, extra_key=info.model)
    held = redis.Redis.from_url(redis_url).smismember(kv_index_key(node_id, info.incarnation), hashes)
    return next((index for index, is_member in enumerate(held) if not is_member), len(held))


def wait_until_indexed(redis_url: str, node_id: str, token_ids: list[int]) -> None:
    """Until the node has published every full block of the prompt (it flushes every 0.1 s)."""
    num_blocks = len(token_ids) // BLOCK_SIZE
    wait_until(lambda: indexed_blocks(redis_url, node_id, token_ids) == num_blocks, 10, f"{node_id}'s KV index")


def wait_for_heartbeat(redis_url: str, node_id: str) -> NodeInfo:
    """The node's registry entry as written by its first heartbeat after now (one a second)."""
    now = time.time()

    def beat_after_now() -> NodeInfo | None:
        info = registered(redis_url, node_id)
        return info if info is not None and info.updated_at > now else None

    return wait_until(beat_after_now, 5, f"a heartbeat of {node_id}")


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Leading full blocks two prompts have in common (the hashes are chained: equal ones lead)."""
    return sum(x == y for x, y in zip(hash_token_blocks(a, BLOCK_SIZE), hash_token_blocks(b, BLOCK_SIZE)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    # Prefill steps of 32 tokens: a burst of cache hits soon queues more than one step,
    # the point where the load cap starts to move prompts (gateway/router.py).
    plan = e2e_plan(
        model, tmp_path_factory.mktemp("logs"), num_prefill=2, prefill_args=("--max-num-batched-tokens", "32")
    )
    with Launcher(plan) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def tokenizer(cluster) -> Tokenizer:
    return Tokenizer.from_folder(cluster.plan.model)


def prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """The token ids the gateway sends for a chat."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


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


def test_requests_sharing_a_system_prompt_land_on_the_node_that_cached_it(cluster, tokenizer):
    base_url, model = cluster.base_url, cluster.plan.model
    conversations = [ask("What opens at nine?")] + [ask(f"Where is shelf {i}?") for i in range(4)]
    _, first = asyncio.run(chat(base_url, model, conversations[0]))
    wait_until_indexed(cluster.redis_url, first["prefill"], prompt_ids(tokenizer, conversations[0]))
    routes = [asyncio.run(chat(base_url, model, messages))[1] for messages in conversations[1:]]

    assert int(first["cached_tokens"]) == 0
    assert {r["prefill"] for r in routes} == {first["prefill"]}
    # Each prompt finds the full blocks it shares with the node's earlier prompts: the system prompt's, and more.
    prompts = [prompt_ids(tokenizer, messages) for messages in conversations]
    shared = [max(shared_blocks(prompt, earlier) for earlier in prompts[:i]) for i, prompt in enumerate(prompts) if i]
    assert [int(r["cached_tokens"]) for r in routes] == [BLOCK_SIZE * n for n in shared]
    assert min(shared) >= 8  # SYSTEM alone is ~150 tokens


async def chats_in_parallel(cluster: Launcher, questions: list[str]) -> list[tuple[str, dict[str, str]]]:
    return await asyncio.gather(
        *(chat(cluster.base_url, cluster.plan.model, [{"role": "user", "content": q}]) for q in questions)
    )


def in_flight(base_url: str) -> float:
    """Requests the gateway's router still counts against some node."""
    return sum(value for _, value in metric_samples(base_url, "pdserve_gateway_in_flight_requests"))


def load_cap_decisions(base_url: str) -> float:
    samples = metric_samples(base_url, "pdserve_gateway_routing_decisions_total", role="prefill", reason="load_cap")
    return sum(value for _, value in samples)


def test_a_burst_on_one_prefix_is_spread_by_the_load_cap(cluster, tokenizer):
    base_url, model = cluster.base_url, cluster.plan.model
    _, warm = asyncio.run(chat(base_url, model, ask("Warm the cache.")))
    wait_until_indexed(cluster.redis_url, warm["prefill"], prompt_ids(tokenizer, ask("Warm the cache.")))

    async def burst():
        return await asyncio.gather(*(chat(base_url, model, ask(f"Burst {i}?")) for i in range(24)))

    capped_before = load_cap_decisions(base_url)
    routes = [route for _, route in asyncio.run(burst())]
    assert {r["prefill"] for r in routes} == {"prefill-0", "prefill-1"}
    assert load_cap_decisions(base_url) > capped_before  # moved by the cap, not by cost
    assert in_flight(base_url) == 0


def test_second_chat_turn_moves_only_new_blocks_and_matches_the_offline_engine(cluster, tokenizer):
    base_url, model, redis_url = cluster.base_url, cluster.plan.model, cluster.redis_url
    turn_1 = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm " * 6}]
    reply_1, _ = asyncio.run(chat(base_url, model, turn_1))
    # The decode node's counters reach Redis with its heartbeats: read them from one sent after the reply.
    blocks_before = wait_for_heartbeat(redis_url, "decode-0").stats.kv_blocks_received
    turn_2 = turn_1 + [{"role": "assistant", "content": reply_1}, {"role": "user", "content": "And then?"}]
    reply_2, route = asyncio.run(chat(base_url, model, turn_2))
    blocks_moved = wait_for_heartbeat(redis_url, "decode-0").stats.kv_blocks_received - blocks_before

    prompt = prompt_ids(tokenizer, turn_2)
    num_prompt_blocks = -(-len(prompt) // BLOCK_SIZE)
    assert int(route["decode_cached_tokens"]) >= 64  # turn 1's prompt blocks stayed on the decode node
    assert blocks_moved == num_prompt_blocks - int(route["decode_cached_tokens"]) // BLOCK_SIZE
    offline = LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_blocks=64)))
    expected = offline.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].token_ids
    assert reply_2 == tokenizer.decode(expected)


def test_a_killed_prefill_nodes_entries_expire_and_its_restart_does_not_inherit_them(cluster):
    base_url, redis_url = cluster.base_url, cluster.redis_url
    asyncio.run(chat(base_url, cluster.plan.model, ask("Fill both caches.")))
    old = registered(redis_url, "prefill-1")
    wait_until(lambda: kv_index_keys(redis_url, "prefill-1"), 10, "prefill-1 to publish its cache")
    cluster.stop_child("prefill-1", signal.SIGKILL)
    started = time.monotonic()
    # Still registered: distinct prompts spread over both nodes by queued work, so some first
    # go to the dead node, fail to connect and are retried on the other.
    tried_before = routed_counts(base_url, "prefill").get("prefill-1", 0)
    replies = asyncio.run(
        chats_in_parallel(cluster, [f"Question {i}: " + "why is the sky blue " * 20 for i in range(6)])
    )
    assert routed_counts(base_url, "prefill").get("prefill-1", 0) > tried_before
    assert all(route["prefill"] == "prefill-0" for _, route in replies)
    assert in_flight(base_url) == 0  # the failed attempts released their nodes too
    wait_until(lambda: not kv_index_keys(redis_url, "prefill-1"), 10, "prefill-1's KV index entries to expire")
    assert time.monotonic() - started <= 3.0 + 1.0  # the registry TTL, plus polling slack
    cluster.start_node("prefill", "prefill-1")  # returns once registered at its new port
    assert registered(redis_url, "prefill-1").incarnation != old.incarnation
    assert not redis.Redis.from_url(redis_url).exists(kv_index_key("prefill-1", old.incarnation))
    for key in kv_index_keys(redis_url, "prefill-1"):
        assert redis.Redis.from_url(redis_url).scard(key) == 0  # a fresh node caches nothing yet
