"""`pdserve prefill`: a prefill node process."""

from __future__ import annotations

import grpc

from cluster.node import NodeSettings, serve_node
from engine.async_engine import AsyncEngine
from kvtransfer.grpc_transport import GrpcKvSender
from prefill_service.servicer import PrefillServicer
from protos import prefill_pb2_grpc


def add_prefill_servicers(server: grpc.aio.Server, async_engine: AsyncEngine, settings: NodeSettings) -> PrefillServicer:
    servicer = PrefillServicer(async_engine, GrpcKvSender())
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    return servicer


def run_prefill_node(settings: NodeSettings) -> None:
    serve_node("prefill", settings, add_prefill_servicers)
