"""GET /v1/models (the one served model) and GET /health (ready when the backend has nodes; its
body counts the registered nodes per role, so that a launcher or test can wait until the gateway
has seen a node join or leave)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.backend import BackendError, BackendErrorKind
from gateway.dependencies import BackendDep, ServedModelDep
from gateway.errors import to_openai_error
from gateway.protocol import ErrorResponse, ModelCard, ModelList

router = APIRouter(tags=["models"])

_STARTED = int(time.time())


@router.get("/v1/models", response_model=ModelList)
async def list_models(served_model: ServedModelDep) -> ModelList:
    card = ModelCard(id=served_model.name, created=_STARTED, max_model_len=served_model.max_model_len)
    return ModelList(data=[card])


@router.get("/health", responses={503: {"model": ErrorResponse, "description": "no node of some needed role"}})
async def health(backend: BackendDep) -> JSONResponse:
    if backend.is_ready():
        return JSONResponse({"status": "ok", "num_nodes": backend.num_nodes_by_role()})
    status, body = to_openai_error(BackendError(BackendErrorKind.UNAVAILABLE, "the cluster has no ready nodes yet"))
    return JSONResponse(body.model_dump(), status_code=status)
