"""Embedded Redis + prefill and decode nodes + gateway, as separate processes, on a tiny model
with the real tokenizer; driven through the official openai client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import openai
import pytest
import redis

from pdserve.launcher import Launcher
from tests.e2e.helpers import REPO_ROOT, e2e_plan, gateway_num_nodes, routed_counts, wait_until
from tests.factories import build_tiny_chat_model

QUESTIONS = [f"Question {i}: tell me about the number {i * 7}." for i in range(16)]
MAX_TOKENS = 12


def num_registered(redis_url: str, prefix: str = "pdserve:node:") -> int:
    return len(list(redis.Redis.from_url(redis_url).scan_iter(f"{prefix}*")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    # Load-based routing: these tests are about nodes joining and leaving. (prefix_aware
    # would keep chats on the decode nodes that already cache the chat template's blocks.)
    plan = e2e_plan(
        model, tmp_path_factory.mktemp("logs"), num_decode=2, gateway_args=("--router-policy", "least_load")
    )
    with Launcher(plan) as launcher:
        yield launcher


def client(cluster: Launcher) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


async def stream_chat(api: openai.AsyncOpenAI, model: str, question: str) -> tuple[str, str]:
    stream = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def offline_generate(model: str, questions: list[str]) -> list[dict]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "generate",
            "--model",
            model,
            "--chat",
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            "--kv-cache-gib",
            "0.05",
            *questions,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_sixteen_concurrent_streaming_chats_match_offline_and_use_both_decode_nodes(cluster):
    api = client(cluster)

    async def run_all():
        model = (await api.models.list()).data[0].id
        return await asyncio.gather(*(stream_chat(api, model, q) for q in QUESTIONS))

    results = asyncio.run(run_all())
    expected = offline_generate(cluster.plan.model, QUESTIONS)
    assert [text for text, _ in results] == [e["text"] for e in expected]
    assert [finish for _, finish in results] == [e["finish_reason"] for e in expected]
    counts = routed_counts(cluster.base_url, "decode")
    # Each chat went to one decode node (none failed); which one depends on the load at arrival.
    assert set(counts) == {"decode-0", "decode-1"} and sum(counts.values()) == len(QUESTIONS), counts


def test_a_late_decode_node_is_used_and_a_dead_one_is_dropped(cluster):
    redis_url, base_url = cluster.redis_url, cluster.base_url
    cluster.start_node("decode", "decode-late")  # returns once registered and counted by the gateway
    assert num_registered(redis_url) == 4
    assert gateway_num_nodes(base_url) == {"prefill": 1, "decode": 3}

    async def chats(n: int):
        api = client(cluster)  # one per event loop
        model = (await api.models.list()).data[0].id
        return await asyncio.gather(*(stream_chat(api, model, q) for q in QUESTIONS[:n]))

    wait_until(
        lambda: asyncio.run(chats(3)) and routed_counts(base_url, "decode").get("decode-late", 0) > 0,
        30,
        "a request routed to the late node",
    )
    cluster.stop_child("decode-late", signal.SIGKILL)  # dies without leaving the registry: only the TTL removes it
    wait_until(lambda: num_registered(redis_url) == 3, 10, "the dead node's entry to expire")
    wait_until(lambda: gateway_num_nodes(base_url) == {"prefill": 1, "decode": 2}, 10, "the gateway to drop it")
    before = routed_counts(base_url, "decode").get("decode-late", 0)
    results = asyncio.run(chats(6))
    assert all(finish == "length" for _, finish in results)
    assert routed_counts(base_url, "decode").get("decode-late", 0) == before


@pytest.mark.parametrize(
    "fields",
    [
        {"colocated": True},
        {"node_args": ("--kv-transport", "grpc")},
    ],
    ids=["colocated", "grpc-page-stream"],
)
def test_other_topologies_serve_the_same_greedy_output(tmp_path, fields):
    model = str(build_tiny_chat_model(tmp_path / "model"))
    with Launcher(e2e_plan(model, tmp_path / "logs", **fields)) as cluster:

        async def chats():
            api = client(cluster)
            model_id = (await api.models.list()).data[0].id
            return await asyncio.gather(*(stream_chat(api, model_id, q) for q in QUESTIONS[:4]))

        results = asyncio.run(chats())
        assert [text for text, _ in results] == [e["text"] for e in offline_generate(model, QUESTIONS[:4])]
        role = "colocated" if fields.get("colocated") else "decode"
        assert routed_counts(cluster.base_url, role) == {f"{role}-0": 4.0}


def test_a_prefill_node_with_another_kv_cache_dtype_serves_through_the_page_stream(tmp_path):
    # Started by hand, nodes that quantize differently get different KV dtypes under auto. The
    # shared-memory path needs one layout, so the pages go over the gRPC stream in the prefill
    # node's dtype and the decode node rounds them into its own cache (every request failed before).
    model = str(build_tiny_chat_model(tmp_path / "model"))
    plan = e2e_plan(model, tmp_path / "logs", prefill_args=("--kv-cache-dtype", "float16"))
    with Launcher(plan) as cluster:

        async def chats():
            api = client(cluster)
            model_id = (await api.models.list()).data[0].id
            return await asyncio.gather(*(stream_chat(api, model_id, q) for q in QUESTIONS[:4]))

        results = asyncio.run(chats())
        assert all(text and finish == "length" for text, finish in results), results
        assert routed_counts(cluster.base_url, "prefill") == {"prefill-0": 4.0}
        assert routed_counts(cluster.base_url, "decode") == {"decode-0": 4.0}
