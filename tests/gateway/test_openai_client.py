"""The official `openai` client against the gateway on a real uvicorn server (fake backend)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.backend import BackendError, BackendErrorKind
from tests.gateway.fakes import DEFAULT_TEXT, text_chunks

MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def openai_client(live_server):
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def test_chat_non_streamed(openai_client, tokenizer):
    completion = openai_client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=32)
    assert completion.choices[0].message.content == DEFAULT_TEXT
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == len(text_chunks(tokenizer, DEFAULT_TEXT))  # one token each, EOS too
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_chat_streamed_with_usage(openai_client, tokenizer):
    stream = openai_client.chat.completions.create(
        model="smollm2", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(text_chunks(tokenizer, DEFAULT_TEXT))


def test_completion_with_stop_string(openai_client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "alpha, beta; gamma")
    completion = openai_client.completions.create(model="smollm2", prompt="Greek letters:", stop=[";"], max_tokens=10)
    assert completion.choices[0].text == "alpha, beta"
    assert completion.choices[0].finish_reason == "stop"
    assert backend.calls[0].stream.closed_early


def test_completion_streamed_with_stop_string(openai_client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "alpha, beta; gamma")
    stream = openai_client.completions.create(model="smollm2", prompt="x", stop=";", stream=True)
    assert "".join(c.choices[0].text for c in stream) == "alpha, beta"


def test_errors_raise_the_matching_client_exceptions(openai_client, backend):
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=9)
    assert bad.value.body["param"] == "temperature"
    backend.error = BackendError(BackendErrorKind.OVERLOADED, "all nodes busy")
    with pytest.raises(openai.RateLimitError):
        openai_client.chat.completions.create(model="smollm2", messages=MESSAGES)


def test_sse_bytes_on_the_wire(live_server):
    """The exact framing a non-Python client parses: `data: {...}\\n\\n` events, then `data: [DONE]\\n\\n`."""
    with httpx.stream(
        "POST", f"{live_server}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        body = response.read().decode()
    assert body.startswith('data: {"id":"chatcmpl-')
    assert body.endswith("}\n\ndata: [DONE]\n\n")


def test_client_closing_the_stream_aborts_the_backend(live_server, backend):
    backend.hang = True  # the generation would never end on its own
    with httpx.stream(
        "POST", f"{live_server}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
    ) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while not (backend.calls and backend.calls[0].stream.closed_early):
        assert time.monotonic() < deadline, "the backend stream was not closed after the client left"
        time.sleep(0.02)
