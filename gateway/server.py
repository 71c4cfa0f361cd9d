"""Runs the gateway with uvicorn: `serve_cluster_gateway` composes it over the cluster's nodes
(what `pdserve gateway` runs); `serve_gateway` serves any backend."""

from __future__ import annotations

import logging

import uvicorn

from gateway.admission import AdmissionControl
from gateway.app import create_app
from gateway.backend import GenerationBackend
from gateway.cluster_backend import ClusterBackend
from gateway.failover import FailoverPolicy
from gateway.node_health import NodeHealthChecker
from gateway.router import Router
from gateway.settings import GatewaySettings
from pdserve.cluster_state.kv_index import KvIndexReader
from pdserve.cluster_state.registry import RegistryView
from pdserve.cluster_state.secret import is_loopback

logger = logging.getLogger(__name__)


def uvicorn_config(settings: GatewaySettings, backend: GenerationBackend) -> uvicorn.Config:
    if not settings.api_key and not is_loopback(settings.host):
        logger.warning(
            "the gateway listens on %s without an API key: anyone who can reach port %d can use it "
            "(give --api-key, or bind 127.0.0.1; see docs/security.md)",
            settings.host,
            settings.port,
        )
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


async def serve_cluster_gateway(settings: GatewaySettings) -> None:
    """Serves the gateway over the nodes registered in `settings.redis_url` until signalled:
    the registry view, the KV index reader and the router feed the cluster backend, and
    admission control bounds the work it takes on. While Redis is away the view keeps the nodes
    that answer the health checker."""
    credentials = settings.channel_credentials()  # None without TLS
    health_checker = NodeHealthChecker(credentials=credentials)
    # The health service is open (pdserve/cluster_state/secret.py): the checker needs no secret.
    registry = RegistryView(settings.redis_url, probe=health_checker.answering, secret=settings.secret_value())
    await registry.start()
    kv_index = KvIndexReader(settings.redis_url)
    router = Router(registry, settings.router_policy, kv_index, settings.router_load_factor)
    backend = ClusterBackend(
        registry,
        router,
        failover=FailoverPolicy(settings.router_max_attempts, settings.router_max_migrations),
        cluster_secret=settings.secret_value(),
        credentials=credentials,
        ssl_context=settings.client_ssl_context(),
    )
    try:
        await serve_gateway(settings, AdmissionControl(backend, settings))
    finally:
        await backend.close()
        await kv_index.close()
        await registry.stop()
        await health_checker.close()
