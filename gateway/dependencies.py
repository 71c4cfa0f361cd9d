"""What a route handler gets injected: the backend and the served model (created in the app's
lifespan) and the request id (set by RequestIdMiddleware)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.backend import GenerationBackend
from gateway.served_model import ServedModel


def get_backend(request: Request) -> GenerationBackend:
    return request.app.state.backend


def get_served_model(request: Request) -> ServedModel:
    return request.app.state.served_model


def get_request_id(request: Request) -> str:
    return request.state.request_id


BackendDep = Annotated[GenerationBackend, Depends(get_backend)]
ServedModelDep = Annotated[ServedModel, Depends(get_served_model)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
