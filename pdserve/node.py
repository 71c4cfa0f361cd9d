"""The node runtime every node process shares: engine start-up, the gRPC server with the standard
health service, registration in Redis, and a clean stop on SIGTERM/SIGINT. What differs by role
(`prefill`, `decode`, `colocated`) comes from the role's `NodeService`.

Lifecycle of a node:
  1. the role's service says where the KV cache lives and which per-layer hook the engine calls;
     the engine is built (model load) in the main thread, which then runs the engine loop
     (torch's CPU kernels run multi-threaded there; a secondary thread got about 1.5x slower steps);
  2. a second thread runs the asyncio loop: the gRPC server with the service's servicers, marked
     SERVING, a decode node's token stream (which the gateway reads tokens from), the
     registration in Redis with heartbeats of the engine's load, and the publication of the
     prefix cache's blocks to the cluster's KV index;
  3. on SIGTERM/SIGINT: mark its entry draining (routers send nothing new), report NOT_SERVING,
     let its open streams and transfers finish (--drain-s), leave the registry, stop the server
     (short grace), close the service, stop the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
import uuid
from typing import Protocol

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_service.server import DecodeNodeService
from kvtransfer.base import KvTransferStats
from kvtransfer.grpc_transport import GRPC_OPTIONS
from pdserve import event_loop
from pdserve.cluster_state.kv_index import KvIndexPublisher
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeRegistration, NodeRole, NodeStats
from pdserve.cluster_state.secret import ClusterSecretServerInterceptor, is_loopback
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_cache import KvCacheStorage
from pdserve.engine.llm_engine import LayerHook, LLMEngine
from pdserve.node_metrics import NodeMetrics
from pdserve.options import NodeSettings
from prefill_service.server import PrefillNodeService

logger = logging.getLogger(__name__)
# A gateway's registry snapshot is at most this old (RegistryView's refresh): a stopping node
# keeps serving this long, so requests routed to it just before it was marked draining are not refused.
DRAIN_LINGER_S = 1.0

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})  # binds that no peer can dial


class NodeService(Protocol):
    """What one role adds to the node runtime (prefill_service and decode_service implement it)."""

    kv_storage: KvCacheStorage | None  # where the engine's KV cache lives; None: local memory
    layer_hook: LayerHook | None  # called after each layer of a step that completes held prompts

    def add_to_server(self, server: grpc.aio.Server, async_engine: AsyncEngine) -> None:
        """Registers the role's servicers (on the event loop, before the server starts)."""
        ...

    async def start_token_stream(self, host: str) -> int | None:
        """Starts the decode roles' token stream on `host` (after add_to_server); its port, or None
        when the node serves none."""
        ...

    async def stop_token_stream(self, grace_s: float) -> None:
        """Stops it: calls still open after `grace_s` are cut (the gateway resumes them)."""
        ...

    def kv_transfer_stats(self) -> KvTransferStats: ...

    async def close(self) -> None:
        """Releases what the service holds (channels, shared memory) after the server stopped."""
        ...


def node_service(role: NodeRole, settings: NodeSettings) -> NodeService:
    if role == "prefill":
        return PrefillNodeService(
            settings.kv_transport,
            settings.kv_lease_s,
            settings.secret_value(),
            settings.redis_url,
            settings.channel_credentials(),
        )
    colocated = role == "colocated"
    return DecodeNodeService(
        settings.kv_transport,
        settings.kv_lease_s,
        settings.max_reserve_wait_s,
        colocated,
        settings.device,
        settings.stream_interval,
        settings.token_stream_port,
        settings.secret_value(),
        settings.server_ssl_context(),
    )


def run_node(role: NodeRole, settings: NodeSettings) -> None:
    """Serves one node until SIGTERM/SIGINT."""
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    service = node_service(role, settings)
    engine = LLMEngine(settings.engine_config(), kv_storage=service.kv_storage, layer_hook=service.layer_hook)
    async_engine = AsyncEngine(engine, output_observer=lambda outputs: metrics.observe(outputs))
    metrics = NodeMetrics(
        role,
        engine.kv_cache_manager.block_pool.num_blocks,
        lambda: async_engine.load,
        engine.counters,
        service.kv_transfer_stats,
    )
    stop_requested = threading.Event()
    signalled: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def on_signal(signum, frame) -> None:
        stop_requested.set()
        for loop, stop in signalled:
            loop.call_soon_threadsafe(stop.set)

    rpc_failure: list[BaseException] = []

    def serve_rpcs() -> None:
        try:
            event_loop.run(_serve(role, settings, service, async_engine, metrics, stop_requested, signalled))
        except BaseException as error:
            rpc_failure.append(error)
            raise
        finally:
            async_engine.stop()  # whatever ended the server ends the engine loop too

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    rpc_thread = threading.Thread(target=serve_rpcs, name="rpc-loop")
    rpc_thread.start()
    async_engine.run_in_current_thread()
    rpc_thread.join()
    if rpc_failure:  # e.g. its port was taken: a supervisor must see a failed start, not exit code 0
        raise SystemExit(f"{role} node stopped: its RPC server failed: {rpc_failure[0]}")


async def _serve(
    role, settings: NodeSettings, service: NodeService, async_engine, metrics: NodeMetrics, stop_requested, signalled
) -> None:
    stop = asyncio.Event()
    signalled.append((asyncio.get_running_loop(), stop))
    if stop_requested.is_set():
        stop.set()
    server, health_servicer, port = await _start_grpc(settings, service, async_engine)
    host = advertised_host(settings.host, settings.advertise_host)
    token_stream_port = await service.start_token_stream(settings.host)
    node_info = _node_info(role, settings, async_engine.engine, host, port)
    if token_stream_port is not None:
        node_info = node_info.model_copy(update={"token_stream_address": f"{host}:{token_stream_port}"})
    metrics.start(node_info.node_id, settings.host, settings.metrics_port, host)
    registration = NodeRegistration(
        settings.redis_url,
        node_info.model_copy(update={"metrics_address": metrics.address}),
        lambda: async_engine.load,
        interval_s=settings.heartbeat_s,
        ttl_s=settings.ttl_s,
        stats_fn=lambda: _node_stats(async_engine.engine, service),
        secret=settings.secret_value(),
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
    await registration.drain()
    await health_servicer.enter_graceful_shutdown()
    await _drain(async_engine, settings.drain_s)
    await kv_index.stop()
    await registration.stop()
    await asyncio.gather(server.stop(grace=2.0), service.stop_token_stream(2.0))
    await service.close()
    metrics.stop()


async def _drain(async_engine: AsyncEngine, timeout_s: float) -> None:
    """Lets the node's work finish (scaling down fails no request that has started here): open
    streams, and KV transfers under way (a decode node's reservations awaiting pages, a prefill
    node's pages held for a push). The node is marked draining in the registry, but a gateway may
    have routed a request here just before it saw that: the node serves at least one registry
    refresh more. What is still open at the deadline is cut, and the gateway resumes it elsewhere."""
    started = time.monotonic()
    work = _work_left(async_engine)
    if work:
        logger.info("draining: %s (at most %.0f s)", work, timeout_s)
    while (work or time.monotonic() < started + DRAIN_LINGER_S) and time.monotonic() < started + timeout_s:
        await asyncio.sleep(0.05)
        work = _work_left(async_engine)
    if work:
        logger.warning("stopping after %.0f s of draining with %s", timeout_s, work)


def _work_left(async_engine: AsyncEngine) -> str:
    """What keeps a stopping node up, in words; empty when nothing does."""
    load = async_engine.load
    counts = {
        "open streams": async_engine.num_open_streams,
        "transfers": load.num_pending_transfers,
        "requests": load.num_running + load.num_waiting_requests,
    }
    return ", ".join(f"{count} {what}" for what, count in counts.items() if count)


async def _start_grpc(settings: NodeSettings, service: NodeService, async_engine: AsyncEngine):
    """The gRPC server with the role's servicers and the standard health service, SERVING; with a
    cluster secret, every call but a health check needs it; with TLS options, it serves TLS only."""
    secret = settings.secret_value()
    if secret is None and not is_loopback(settings.host):
        logger.warning(
            "serving gRPC on %s without a cluster secret: anyone who reaches the port can call the node; "
            "give every node and the gateway the same --cluster-secret",
            settings.host,
        )
    interceptors = [ClusterSecretServerInterceptor(secret)] if secret else []
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service.add_to_server(server, async_engine)
    address, credentials = f"{settings.host}:{settings.port}", settings.server_credentials()
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


def _node_stats(engine: LLMEngine, service: NodeService) -> NodeStats:
    # Plain int reads from the engine thread's counters: a heartbeat may lag a step, never tear.
    cache = engine.kv_cache_manager
    transfer = service.kv_transfer_stats()
    return NodeStats(
        prefix_query_tokens=cache.num_prefix_queries,
        prefix_hit_tokens=cache.num_prefix_hits,
        kv_blocks_received=transfer.num_blocks_received,
        kv_bytes_received=transfer.num_bytes_received,
    )


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host the gateway and other nodes dial: --advertise-host, or --host. `auto`, and a
    wildcard bind without an advertised host, mean this machine's own address (in a container: its
    address on the compose network, which every replica has its own of)."""
    if advertise_host and advertise_host != "auto":
        return advertise_host
    if advertise_host == "auto" or host in WILDCARD_HOSTS:
        return socket.gethostbyname(socket.gethostname())
    return host


def _node_info(role: NodeRole, settings: NodeSettings, engine: LLMEngine, host: str, port: int) -> NodeInfo:
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
