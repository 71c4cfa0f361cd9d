"""Every failure is an OpenAI error object with the right status; never FastAPI's {"detail": ...}."""

from __future__ import annotations

import pytest

from gateway.backend import BackendError, BackendErrorKind
from tests.gateway.fakes import parse_sse

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_malformed_json_is_400(client):
    response = client.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


def test_unknown_route_is_404(client):
    error = assert_openai_error(client.post("/v1/nothing", json={}), 404, code="not_found")
    assert "/v1/nothing" in error["message"]


def test_wrong_method_is_405(client):
    response = client.get("/v1/chat/completions")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ],
)
def test_invalid_chat_fields_are_400_with_param(client, fields, param):
    error = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, **fields}), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**7]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"echo": True}, "echo"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_completion_fields_are_400_with_param(client, fields, param):
    assert_openai_error(client.post("/v1/completions", json={"prompt": "x", **fields}), 400, param=param)


def test_context_overflow_is_400(client, settings):
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": settings.max_model_len})
    error = assert_openai_error(response, 400, param="max_tokens", code="context_length_exceeded")
    assert str(settings.max_model_len) in error["message"]
    response = client.post("/v1/completions", json={"prompt": [100] * settings.max_model_len})
    assert_openai_error(response, 400, param="prompt", code="context_length_exceeded")


def test_unknown_model_is_404(client):
    assert_openai_error(
        client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, param="model", code="model_not_found"
    )


def test_template_rejection_is_400(client, backend):
    # SmolLM's template concatenates content: a message without content cannot render.
    response = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user"}]})
    assert_openai_error(response, 400, param="messages")
    assert backend.calls == []


@pytest.mark.parametrize(
    ("kind", "status", "error_type"),
    [
        (BackendErrorKind.INVALID_REQUEST, 400, "invalid_request_error"),
        (BackendErrorKind.OVERLOADED, 429, "rate_limit_error"),
        (BackendErrorKind.UNAVAILABLE, 503, "server_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors_before_output_map_to_status(client, backend, kind, status, error_type, stream):
    backend.error = BackendError(kind, "nodes said no")
    response = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    error = assert_openai_error(response, status, code=kind.value)
    assert error["type"] == error_type
    assert error["message"] == "nodes said no"


def test_backend_error_mid_stream_is_an_error_event(client, backend):
    backend.error = BackendError(BackendErrorKind.UNAVAILABLE, "decode node died")
    backend.error_after = 3
    response = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    events = parse_sse(response.text)
    assert events[-2]["error"]["message"] == "decode node died"
    assert events[-2]["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"


def test_unexpected_exception_is_500(client, backend):
    def broken_script(prompt, params):
        raise RuntimeError("bug")

    backend.script = broken_script
    error = assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 500)
    assert error["type"] == "server_error"
    assert "bug" not in error["message"], "internal details stay in the log"
