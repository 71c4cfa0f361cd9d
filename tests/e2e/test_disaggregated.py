"""Embedded Redis + prefill and decode nodes + gateway, as separate processes, on a tiny model
with the real tokenizer; driven through the official openai client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import openai
import pytest
import redis

from tests.e2e.processes import REPO_ROOT, routed_counts, running_cluster, wait_until
from tests.factories import build_tiny_chat_model

QUESTIONS = [f"Question {i}: tell me about the number {i * 7}." for i in range(16)]
MAX_TOKENS = 12


def num_registered(redis_url: str, prefix: str = "pdserve:node:") -> int:
    return len(list(redis.Redis.from_url(redis_url).scan_iter(f"{prefix}*")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    nodes = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]
    # Load-based routing: these tests are about nodes joining and leaving. (prefix_aware
    # would keep chats on the decode nodes that already cache the chat template's blocks.)
    with running_cluster(model, tmp_path_factory.mktemp("logs"), nodes, "--router-policy", "least_load") as running:
        yield running


def client(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster['base_url']}/v1", api_key="unused", max_retries=0)


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
    expected = offline_generate(cluster["model"], QUESTIONS)
    assert [text for text, _ in results] == [e["text"] for e in expected]
    assert [finish for _, finish in results] == [e["finish_reason"] for e in expected]
    counts = routed_counts(cluster["base_url"], "decode")
    assert counts.get("decode-0", 0) > 0 and counts.get("decode-1", 0) > 0, counts


def test_a_late_decode_node_is_used_and_a_dead_one_is_dropped(cluster):
    group, redis_url, base_url = cluster["group"], cluster["redis_url"], cluster["base_url"]
    group.start_node("decode", "decode-late", cluster["model"], redis_url)
    wait_until(lambda: num_registered(redis_url) == 4, 120, "the late decode node to register")

    async def chats(n: int):
        api = client(cluster)  # one per event loop
        model = (await api.models.list()).data[0].id
        return await asyncio.gather(*(stream_chat(api, model, q) for q in QUESTIONS[:n]))

    wait_until(
        lambda: asyncio.run(chats(3)) and routed_counts(base_url, "decode").get("decode-late", 0) > 0,
        30,
        "a request routed to the late node",
    )
    group.stop("decode-late", signal.SIGKILL)  # dies without leaving the registry: only the TTL removes it
    wait_until(lambda: num_registered(redis_url) == 3, 10, "the dead node's entry to expire")
    time.sleep(1.0)  # the gateway's registry snapshot refreshes every 0.5 s
    before = routed_counts(base_url, "decode").get("decode-late", 0)
    results = asyncio.run(chats(6))
    assert all(finish == "length" for _, finish in results)
    assert routed_counts(base_url, "decode").get("decode-late", 0) == before


@pytest.mark.parametrize(
    "nodes",
    [
        [("colocated", "colocated-0")],
        [("prefill", "prefill-0", "--kv-transport", "grpc"), ("decode", "decode-0", "--kv-transport", "grpc")],
    ],
    ids=["colocated", "grpc-page-stream"],
)
def test_other_topologies_serve_the_same_greedy_output(tmp_path, nodes):
    model = str(build_tiny_chat_model(tmp_path / "model"))
    (tmp_path / "logs").mkdir()
    with running_cluster(model, tmp_path / "logs", nodes) as running:
        base_url = running["base_url"]

        async def chats():
            api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
            model_id = (await api.models.list()).data[0].id
            return await asyncio.gather(*(stream_chat(api, model_id, q) for q in QUESTIONS[:4]))

        results = asyncio.run(chats())
        assert [text for text, _ in results] == [e["text"] for e in offline_generate(model, QUESTIONS[:4])]
        role, name = nodes[-1][:2]
        assert routed_counts(base_url, role) == {name: 4.0}
