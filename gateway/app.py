"""The gateway's FastAPI app: OpenAI-compatible routes over a GenerationBackend."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import make_asgi_app
from pydantic.json_schema import models_json_schema

from gateway.auth import ApiKeyMiddleware, document_api_keys
from gateway.backend import GenerationBackend
from gateway.errors import install_error_handlers
from gateway.limits import BodySizeLimitMiddleware
from gateway.protocol import ChatCompletionChunk, CompletionChunk
from gateway.request_id import RequestIdMiddleware
from gateway.routes import chat, completions, models
from gateway.served_model import load_served_model
from gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

STREAM_CHUNK_MODELS = (CompletionChunk, ChatCompletionChunk)


def create_app(settings: GatewaySettings, backend: GenerationBackend) -> FastAPI:
    """The app; the model's tokenizer loads when it starts (lifespan), the backend is the caller's."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.backend = backend
        app.state.served_model = load_served_model(settings)
        logger.info(
            "gateway serves %s (max_model_len %d)", app.state.served_model.name, app.state.served_model.max_model_len
        )
        yield

    app = FastAPI(title="pdserve gateway", summary="OpenAI-compatible API of a pdserve cluster", lifespan=lifespan)
    install_error_handlers(app)
    app.state.request_limits = settings  # the RequestLimitOptions the routes check
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_request_body_bytes)
    # Inside RequestIdMiddleware, so that a 401 carries its x-request-id too.
    app.add_middleware(
        ApiKeyMiddleware, api_keys=settings.api_key, metrics_require_api_key=settings.metrics_require_api_key
    )
    app.add_middleware(RequestIdMiddleware)
    for module in (completions, chat, models):
        app.include_router(module.router)
    app.mount("/metrics", make_asgi_app())  # Prometheus: routing decisions and the like
    app.openapi = lambda: _openapi_schema(app, with_api_keys=bool(settings.api_key))
    return app


def _openapi_schema(app: FastAPI, with_api_keys: bool = False) -> dict[str, Any]:
    """FastAPI's schema plus the streamed chunk models (no route returns them as JSON, so FastAPI
    alone would not list them), without its 422 responses (validation errors are 400 here)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # Validation mode documents ChatDelta's fields; its serializer only drops the unset ones.
        _, chunk_schemas = models_json_schema(
            [(model, "validation") for model in STREAM_CHUNK_MODELS], ref_template="#/components/schemas/{model}"
        )
        for name, model_schema in chunk_schemas.get("$defs", {}).items():
            components.setdefault(name, model_schema)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        if with_api_keys:
            document_api_keys(schema)
        app.openapi_schema = schema
    return app.openapi_schema
