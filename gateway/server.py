"""Runs the gateway with uvicorn. The caller (the `pdserve` CLI) builds the settings and backend."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.backend import GenerationBackend
from gateway.settings import GatewaySettings


def uvicorn_config(settings: GatewaySettings, backend: GenerationBackend) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings, backend),
        host=settings.host,
        port=settings.port,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),  # the process-wide level
        access_log=settings.access_log,
        log_config=None,  # keep the process's logging set-up (pdserve.log_setup)
    )


async def serve_gateway(settings: GatewaySettings, backend: GenerationBackend) -> None:
    """Serves until cancelled or signalled; for callers that already run an event loop."""
    await uvicorn.Server(uvicorn_config(settings, backend)).serve()
