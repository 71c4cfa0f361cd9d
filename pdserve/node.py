"""What every node process shares: settings, engine start-up, the gRPC server with the
standard health service, registration in Redis, and a clean stop on SIGTERM/SIGINT.

Lifecycle of a node:
  1. build the engine (model load) in the main thread, which then runs the engine loop (torch's
     CPU kernels run multi-threaded there; a secondary thread got about 1.5x slower steps);
  2. a second thread runs the asyncio loop: the gRPC server with the role's servicers, marked
     SERVING, the registration in Redis with heartbeats of the engine's load, and the
     publication of the prefix cache's blocks to the cluster's KV index;
  3. on SIGTERM/SIGINT: leave the registry, stop the server (short grace), stop the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import uuid
from collections.abc import Callable

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtransfer.grpc_transport import GRPC_OPTIONS
from pdserve.cluster_state.kv_index import KvIndexPublisher
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeLoad, NodeRegistration, NodeStats
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class NodeSettings(BaseSettings):
    """One node's settings (env prefix PDSERVE_NODE_, or CLI flags)."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_NODE_")

    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None  # address others dial; defaults to host
    redis_url: str = "redis://127.0.0.1:6379/0"
    node_id: str = ""
    num_threads: int = 0  # 0: torch's default
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    kv_timeout_s: float = 30.0
    kv_transport: str = "auto"  # auto: shared memory between same-host nodes, else gRPC; grpc; shm
    heartbeat_s: float = 1.0
    ttl_s: float = 3.0

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_flags(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            kv_cache_gib=self.kv_cache_gib,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching,
        )


AddServicers = Callable[[grpc.aio.Server, AsyncEngine, NodeSettings], object]


def serve_node(role: str, settings: NodeSettings, add_servicers: AddServicers) -> None:
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    async_engine = AsyncEngine(LLMEngine(settings.engine_config()))
    stop_requested = threading.Event()
    signalled: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def on_signal(signum, frame) -> None:
        stop_requested.set()
        for loop, stop in signalled:
            loop.call_soon_threadsafe(stop.set)

    def serve_rpcs() -> None:
        try:
            asyncio.run(_serve(role, settings, add_servicers, async_engine, stop_requested, signalled))
        finally:
            async_engine.stop()  # whatever ended the server ends the engine loop too

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    rpc_thread = threading.Thread(target=serve_rpcs, name="rpc-loop")
    rpc_thread.start()
    async_engine.run_in_current_thread()
    rpc_thread.join()


async def _serve(role, settings, add_servicers, async_engine, stop_requested, signalled) -> None:
    engine = async_engine.engine
    stop = asyncio.Event()
    signalled.append((asyncio.get_running_loop(), stop))
    if stop_requested.is_set():
        stop.set()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    resources = add_servicers(server, async_engine, settings)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    registration = NodeRegistration(
        settings.redis_url,
        _node_info(role, settings, engine, port),
        lambda: NodeLoad(**async_engine.load),
        interval_s=settings.heartbeat_s,
        ttl_s=settings.ttl_s,
        stats_fn=lambda: _node_stats(engine, resources),
    )
    await registration.start()
    kv_index = KvIndexPublisher(
        settings.redis_url,
        registration.node_info,
        lambda full: async_engine.call(lambda engine: engine.kv_cache_changes(full)),
        ttl_s=settings.ttl_s,
    )
    await kv_index.start()
    logger.info("%s node %s serving on %s:%d", role, registration.node_info.node_id, settings.host, port)
    await stop.wait()
    logger.info("stopping %s node", role)
    await kv_index.stop()
    await registration.stop()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    if hasattr(resources, "close"):
        await resources.close()


def _node_stats(engine: LLMEngine, resources) -> NodeStats:
    # Plain int reads from the engine thread's counters: a heartbeat may lag a step, never tear.
    cache = engine.kv_cache_manager
    transfer = resources.stats() if hasattr(resources, "stats") else {}
    return NodeStats(prefix_query_tokens=cache.num_prefix_queries, prefix_hit_tokens=cache.num_prefix_hits, **transfer)


def _node_info(role: str, settings: NodeSettings, engine: LLMEngine, port: int) -> NodeInfo:
    host = settings.advertise_host or settings.host
    return NodeInfo(
        node_id=settings.node_id or f"{role}-{socket.gethostname()}-{port}-{uuid.uuid4().hex[:6]}",
        role=role,
        address=f"{host}:{port}",
        model=engine.served_model_name,
        capacity=NodeCapacity(
            num_blocks=engine.kv_cache_manager.block_pool.num_blocks,
            block_size=settings.block_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        ),
    )
