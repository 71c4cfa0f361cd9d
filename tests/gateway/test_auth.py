"""API keys (gateway/auth.py): open without keys; with keys, 401 in OpenAI's shape unless the
request carries `Authorization: Bearer <key>`, with /health (and /metrics by default) open."""

from __future__ import annotations

import logging

import openai
import pytest
from fastapi.testclient import TestClient

from gateway import app as gateway_app
from gateway.app import create_app
from gateway.auth import ApiKeyChecker
from gateway.server import uvicorn_config
from gateway.settings import GatewaySettings
from pdserve.cluster_state.secret import is_loopback
from tests.gateway.fakes import DEFAULT_TEXT

KEYS = ["sk-first", "sk-second"]
COMPLETION = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4}
MESSAGES = [{"role": "user", "content": "Say hello."}]


def keyed_client(settings, backend, served_model, monkeypatch, **update):
    monkeypatch.setattr(gateway_app, "load_served_model", lambda _settings: served_model)
    return TestClient(create_app(settings.model_copy(update=update), backend), raise_server_exceptions=False)


@pytest.fixture
def keyed(settings, backend, served_model, monkeypatch):
    with keyed_client(settings, backend, served_model, monkeypatch, api_key=KEYS) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_invalid_api_key(response):
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    return error


def test_without_keys_the_api_is_open(client):
    assert client.get("/v1/models").status_code == 200
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")],
)
def test_with_keys_a_request_without_one_gets_401(keyed, method, path):
    error = assert_invalid_api_key(keyed.request(method, path, json=COMPLETION))
    assert "Authorization: Bearer" in error["message"]


@pytest.mark.parametrize(
    "headers",
    [bearer("sk-wrong"), bearer("sk-first-and-more"), bearer(""), {"Authorization": "Basic sk-first"}, {"X": "y"}],
)
def test_a_wrong_key_or_scheme_gets_401(keyed, headers, backend):
    assert_invalid_api_key(keyed.post("/v1/completions", json=COMPLETION, headers=headers))
    assert backend.calls == []  # refused before the backend saw it


def test_any_configured_key_is_accepted(keyed):
    for key in KEYS:
        response = keyed.post("/v1/completions", json=COMPLETION, headers=bearer(key))
        assert response.status_code == 200
    assert keyed.get("/v1/models", headers={"authorization": "bearer sk-second"}).status_code == 200


def test_health_and_schema_stay_open(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/openapi.json").status_code == 200


def test_metrics_are_open_by_default(keyed):
    assert keyed.get("/metrics/").status_code == 200


def test_metrics_can_require_a_key(settings, backend, served_model, monkeypatch):
    with keyed_client(
        settings, backend, served_model, monkeypatch, api_key=KEYS, metrics_require_api_key=True
    ) as client:
        assert_invalid_api_key(client.get("/metrics/"))
        assert_invalid_api_key(client.get("/metrics"))
        assert client.get("/metrics/", headers=bearer(KEYS[0])).status_code == 200
        assert client.get("/health").status_code == 200


def test_openapi_declares_the_bearer_scheme_and_401_on_protected_routes(keyed):
    schema = keyed.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "one of the gateway's API keys (--api-key)",
    }
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        for operation in schema["paths"][path].values():
            assert operation["security"] == [{"bearerAuth": []}]
            assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"
            }
    assert "security" not in schema["paths"]["/health"]["get"]
    assert "ErrorDetail" in schema["components"]["schemas"]


def test_openapi_without_keys_declares_no_security(client):
    schema = client.get("/openapi.json").json()
    assert "securitySchemes" not in schema.get("components", {})
    assert all("401" not in op["responses"] for path in schema["paths"].values() for op in path.values())


def test_the_checker_compares_every_key():
    checker = ApiKeyChecker(KEYS)
    assert checker.accepts("sk-first") and checker.accepts("sk-second")
    assert not checker.accepts("sk-firs") and not checker.accepts("SK-FIRST") and not checker.accepts("é")
    assert not ApiKeyChecker([]).enabled


def test_keys_come_from_the_environment_comma_separated(monkeypatch, settings):
    monkeypatch.setenv("PDSERVE_GATEWAY_API_KEY", " sk-a, sk-b ,,")
    monkeypatch.setenv("PDSERVE_GATEWAY_METRICS_REQUIRE_API_KEY", "true")
    from_env = GatewaySettings(model=settings.model)
    assert from_env.api_key == ["sk-a", "sk-b"]
    assert from_env.metrics_require_api_key is True
    assert "sk-a" not in repr(from_env)  # keys stay out of logged settings


class TestOpenAIClient:
    @pytest.fixture
    def settings(self, settings):  # live_server serves these
        return settings.model_copy(update={"api_key": KEYS})

    def test_the_right_key_is_accepted_and_a_wrong_one_raises(self, live_server):
        with openai.OpenAI(base_url=f"{live_server}/v1", api_key=KEYS[1], max_retries=0, timeout=30) as client:
            completion = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=32)
            assert completion.choices[0].message.content == DEFAULT_TEXT
            assert [model.id for model in client.models.list()] == ["smollm2"]
        with openai.OpenAI(base_url=f"{live_server}/v1", api_key="sk-wrong", max_retries=0, timeout=30) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=32)
            assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.1", False), ("::1", False), ("0.0.0.0", True)])
def test_binding_beyond_loopback_without_a_key_warns(settings, backend, caplog, host, warned):
    with caplog.at_level(logging.WARNING, logger="gateway.server"):
        uvicorn_config(settings.model_copy(update={"host": host}), backend)
        uvicorn_config(settings.model_copy(update={"host": host, "api_key": KEYS}), backend)
    messages = [r.getMessage() for r in caplog.records if r.name == "gateway.server"]
    assert len(messages) == int(warned)
    assert all(f"listens on {host} without an API key" in message for message in messages)


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("gateway.example")
