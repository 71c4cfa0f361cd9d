"""API keys: with keys configured, every request needs `Authorization: Bearer <key>` (what
OpenAI's clients send), except the open paths: /health, the OpenAPI schema and its docs, and
/metrics unless `metrics_require_api_key`. Protecting by default (rather than route by route)
means a route added later is never open by mistake.

A missing or wrong key gets 401 with the OpenAI error body (code `invalid_api_key`) and
`WWW-Authenticate: Bearer`, before the request's body is read."""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import RequestError, to_openai_error
from gateway.protocol import ErrorResponse

SECURITY_SCHEME = "bearerAuth"
ALWAYS_OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
METRICS_PATH = "/metrics"
MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
    "(i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY_MESSAGE = "Incorrect API key provided."


class ApiKeyChecker:
    """Compares a presented key with every configured one in constant time."""

    def __init__(self, api_keys: Sequence[str]) -> None:
        self._keys = [key.encode() for key in api_keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def accepts(self, presented: str) -> bool:
        candidate = presented.encode()
        # No early exit: the time taken does not say which key (or how much of one) matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        return matched


class ApiKeyMiddleware:
    """Plain ASGI (like RequestIdMiddleware): a refused request never reaches the app or its body."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], metrics_require_api_key: bool = False) -> None:
        self.app = app
        self.checker = ApiKeyChecker(api_keys)
        self.metrics_require_api_key = metrics_require_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.checker.enabled or self._is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        presented = _bearer_token(scope)
        if presented is not None and self.checker.accepts(presented):
            await self.app(scope, receive, send)
            return
        await _send_unauthorized(send, MISSING_KEY_MESSAGE if presented is None else WRONG_KEY_MESSAGE)

    def _is_open(self, path: str) -> bool:
        if path in ALWAYS_OPEN_PATHS:
            return True
        is_metrics = path == METRICS_PATH or path.startswith(METRICS_PATH + "/")
        return is_metrics and not self.metrics_require_api_key


def document_api_keys(schema: dict[str, Any]) -> None:
    """Declares the bearer scheme, and the 401, on every operation the middleware protects."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "one of the gateway's API keys (--api-key)",
    }
    for path, operations in schema.get("paths", {}).items():
        if path in ALWAYS_OPEN_PATHS:
            continue
        for operation in operations.values():
            operation["security"] = [{SECURITY_SCHEME: []}]
            operation.setdefault("responses", {})["401"] = {
                "description": "missing or wrong API key",
                "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
            }
    _, error_schemas = models_json_schema([(ErrorResponse, "validation")], ref_template="#/components/schemas/{model}")
    for name, model_schema in error_schemas["$defs"].items():
        components.setdefault("schemas", {}).setdefault(name, model_schema)


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


async def _send_unauthorized(send: Send, message: str) -> None:
    status, body = to_openai_error(RequestError(message, code="invalid_api_key", status_code=401))
    payload = json.dumps(body.model_dump()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
