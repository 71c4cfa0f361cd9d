"""Request limits (gateway/limits.py): the body size is a 413 before the body is read whole; choices,
stop sequences, logprobs and max_tokens beyond their settings are 400s naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from gateway import app as gateway_app
from gateway.app import create_app
from gateway.routes import completions
from tests.gateway.test_errors import assert_openai_error

COMPLETION = {"model": "smollm2", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def limited_client(settings, backend, served_model, monkeypatch):
    """A client over an app with small limits."""
    monkeypatch.setattr(gateway_app, "load_served_model", lambda _settings: served_model)
    limits = {
        "max_request_body_bytes": 4096,
        "max_choices_per_request": 4,
        "max_stop_strings": 2,
        "max_stop_string_chars": 8,
        "max_stop_token_ids": 2,
        "max_logprobs": 3,
        "max_output_tokens": 5,
    }
    with TestClient(create_app(settings.model_copy(update=limits), backend), raise_server_exceptions=False) as client:
        yield client


def test_a_body_over_the_limit_is_413(limited_client, backend):
    response = limited_client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 5000})
    error = assert_openai_error(response, 413, code="request_too_large")
    assert "4096" in error["message"]
    assert response.headers["connection"] == "close"
    assert backend.calls == []


def test_a_streamed_body_over_the_limit_is_413_before_it_is_read_whole(limited_client):
    """No Content-Length (chunked): the middleware stops reading once the count passes the limit."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    response = limited_client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413, code="request_too_large")


def test_the_default_body_limit_is_8_mib(client):
    response = client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * (9 * 1024 * 1024)})
    assert_openai_error(response, 413, code="request_too_large")


def test_a_body_under_the_limit_passes(limited_client):
    assert limited_client.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a", "b", "c"], "n": 2}, "n"),  # 6 generations > 4
        ({"n": 5}, "n"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "123456789"}, "stop"),
        ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
        ({"logprobs": 4}, "logprobs"),
        ({"max_tokens": 6}, "max_tokens"),
    ],
)
def test_completion_limits_are_400(limited_client, backend, fields, param):
    assert_openai_error(limited_client.post("/v1/completions", json={**COMPLETION, **fields}), 400, param=param)
    assert backend.calls == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 5}, "n"),
        ({"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
        ({"max_completion_tokens": 6}, "max_tokens"),
    ],
)
def test_chat_limits_are_400(limited_client, fields, param):
    assert_openai_error(limited_client.post("/v1/chat/completions", json={**CHAT, **fields}), 400, param=param)


def test_requests_at_the_limits_pass(limited_client, backend):
    fields = {"prompt": ["a", "b"], "n": 2, "stop": ["12345678", "b"], "stop_token_ids": [1, 2], "logprobs": 3}
    response = limited_client.post("/v1/completions", json={**COMPLETION, **fields, "max_tokens": 5})
    assert response.status_code == 200, response.text
    assert len(backend.calls) == 4


def test_max_output_tokens_caps_the_default(limited_client, backend):
    body = {key: value for key, value in CHAT.items() if key != "max_tokens"}
    assert limited_client.post("/v1/chat/completions", json=body).status_code == 200
    assert backend.calls[0].params.max_tokens == 5


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a"] * 8, "n": 128}, "n"),  # the issue's 1,024 generations
        ({"stop": ["x"] * 10_000}, "stop"),
        ({"stop": "x" * 1_000_000}, "stop"),
        ({"stop_token_ids": [1] * 10_000}, "stop_token_ids"),
    ],
)
def test_default_limits_refuse_the_issues_requests(client, fields, param):
    assert_openai_error(client.post("/v1/completions", json={**COMPLETION, **fields}), 400, param=param)


def test_prompts_are_tokenized_off_the_event_loop(client, monkeypatch):
    tokenize = completions.tokenize_prompts
    loops = []

    def recording_tokenize(*args):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:
            loops.append(None)  # a worker thread: no event loop here
        return tokenize(*args)

    monkeypatch.setattr(completions, "tokenize_prompts", recording_tokenize)
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert loops == [None]


def test_health_answers_while_a_large_prompt_is_tokenized(live_server):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=live_server, timeout=60) as http:
            prompt = "lorem ipsum dolor " * 400_000  # 7 MiB: a second or more of tokenization
            big = asyncio.create_task(http.post("/v1/completions", json={**COMPLETION, "prompt": prompt}))
            await asyncio.sleep(0.3)
            health = await http.get("/health", timeout=1.0)
            assert health.status_code == 200
            assert not big.done(), "the big prompt finished before /health was asked: the test shows nothing"
            assert (await big).status_code == 400  # far past max_model_len

    asyncio.run(run())
