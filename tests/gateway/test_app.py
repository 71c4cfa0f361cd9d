"""The app as a whole: models and health routes, request ids, OpenAPI schema, settings, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

from gateway.served_model import load_served_model
from gateway.settings import GatewaySettings
from pdserve.engine.model_loader import DEFAULT_MODEL


def test_models_lists_the_served_model(client, settings):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "smollm2"
    assert card["object"] == "model"
    assert card["max_model_len"] == settings.max_model_len


def test_health_follows_the_backend(client, backend):
    assert client.get("/health").status_code == 200
    backend.ready = False
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


def test_every_response_has_a_request_id(client):
    ids = {client.get("/v1/models").headers["x-request-id"], client.get("/nowhere").headers["x-request-id"]}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)


def test_openapi_documents_requests_responses_and_stream_chunks(client):
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for name in (
        "ChatCompletionRequest",
        "ChatCompletionResponse",
        "ChatCompletionChunk",
        "ChatDelta",
        "CompletionRequest",
        "CompletionResponse",
        "CompletionChunk",
        "ErrorResponse",
        "ModelList",
    ):
        assert name in components, name
    assert set(components["ChatDelta"]["properties"]) == {"role", "content"}
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["responses"]["200"]["content"]["text/event-stream"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionChunk"
    }
    assert chat["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionResponse"
    }
    assert chat["responses"]["429"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    assert "422" not in chat["responses"], "validation errors are 400 here"
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert completions["text/event-stream"]["schema"] == {"$ref": "#/components/schemas/CompletionChunk"}
    refs = set(_refs(schema))
    assert refs <= {f"#/components/schemas/{name}" for name in components}, "every $ref resolves"


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_gateway_never_imports_torch():
    code = (
        "import sys, gateway.app, gateway.server, gateway.routes.chat, gateway.routes.completions;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(result.stdout.replace("'", '"')) == []


def test_settings_read_the_gateway_env_prefix(monkeypatch):
    monkeypatch.setenv("PDSERVE_GATEWAY_PORT", "9123")
    monkeypatch.setenv("PDSERVE_GATEWAY_REDIS_URL", "redis://example:6379")
    settings = GatewaySettings(host="0.0.0.0")
    assert (settings.port, settings.redis_url, settings.host) == (9123, "redis://example:6379", "0.0.0.0")


def test_served_model_defaults_come_from_the_model_folder(default_model_path):
    served = load_served_model(GatewaySettings(model=DEFAULT_MODEL))
    config = json.loads((default_model_path / "config.json").read_text())
    assert served.max_model_len == config["max_position_embeddings"]
    assert served.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served.tokenizer.eos_token_ids == (2,)
    assert served.accepted_names == {served.name, DEFAULT_MODEL}
