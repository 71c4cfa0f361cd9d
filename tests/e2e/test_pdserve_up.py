"""The real default model through `pdserve up` (embedded Redis, 1 prefill + 1 decode, gateway),
with two non-default flags the other end-to-end tests leave at their defaults: the decode node
streams 4 tokens per chunk (`--stream-interval 4`), and both nodes keep a float16 KV cache under
the float32 weights (`--kv-cache-dtype float16`: the prefill node's pages reach the decode node
in float16, and its decode steps read them so)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import openai
import pytest

from pdserve.cluster_state.embedded_redis import free_port
from tests.e2e.helpers import REPO_ROOT

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pdserve-up-logs")


@pytest.fixture(scope="module")
def base_url(log_dir):
    port = free_port()
    flags = ["--stream-interval", "4", "--kv-cache-dtype", "float16", "--log-dir", str(log_dir)]
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), *flags],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    ready = threading.Event()

    def read_output():
        for line in process.stdout:
            lines.append(line)
            if line.startswith("ready on http://"):
                ready.set()

    threading.Thread(target=read_output, daemon=True).start()
    try:
        if not ready.wait(timeout=300):
            pytest.fail("pdserve up never printed 'ready on':\n" + "".join(lines[-40:]))
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(lines[-40:])


def test_chat_completion_streaming_and_not(base_url):
    api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 10
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content


def test_completion_with_a_stop_string(base_url):
    api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    full = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    assert " 7," in full.choices[0].text
    stopped = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full.choices[0].text.split(" 7")[0]
    # The chunk holding " 7" ran past it: only the tokens up to the stop string count.
    scored = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, logprobs=0)
    tokens = scored.choices[0].logprobs.tokens
    num_up_to_stop = next(n for n in range(1, len(tokens) + 1) if " 7" in "".join(tokens[:n]))
    assert stopped.usage.completion_tokens == num_up_to_stop < len(tokens)


def test_both_nodes_keep_a_float16_kv_cache(base_url, log_dir):
    for node in ("prefill-0", "decode-0"):
        log = (log_dir / f"{node}.log").read_text()
        assert "KV cache:" in log and "tokens (float16)" in log, log[-2000:]
