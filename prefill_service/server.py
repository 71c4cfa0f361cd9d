"""`pdserve prefill`: a prefill node process."""

from __future__ import annotations

import grpc

from kvtransfer.grpc_transport import GrpcKvSender
from kvtransfer.shm_transport import ShmKvSender
from pdserve.engine.async_engine import AsyncEngine
from pdserve.node import NodeSettings, serve_node
from prefill_service.servicer import PrefillServicer
from protos import prefill_pb2_grpc


def add_prefill_servicers(
    server: grpc.aio.Server, async_engine: AsyncEngine, settings: NodeSettings
) -> PrefillServicer:
    # auto and shm: shared memory when the decode node shares this host, else the gRPC stream.
    sender = GrpcKvSender() if settings.kv_transport == "grpc" else ShmKvSender(require=settings.kv_transport == "shm")
    servicer = PrefillServicer(async_engine, sender)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    return servicer


def run_prefill_node(settings: NodeSettings) -> None:
    serve_node("prefill", settings, add_prefill_servicers)
