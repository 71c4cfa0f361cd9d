"""`pdserve decode` and `pdserve colocated`: decode node processes.

A colocated node is a decode node whose requests all ask for `local_prefill`: prefill and
decode share one engine and one continuous batch, with no KV transfer."""

from __future__ import annotations

import grpc

from decode_service.servicer import DecodeServicer
from kvtransfer.base import KvReceiver
from kvtransfer.grpc_transport import KvTransferServicer
from kvtransfer.shm_transport import SharedKvCache, host_id
from pdserve.engine.async_engine import AsyncEngine
from pdserve.node import NodeSettings, serve_node
from protos import decode_pb2_grpc


def add_decode_servicers(server: grpc.aio.Server, async_engine: AsyncEngine, settings: NodeSettings) -> DecodeServicer:
    shared = None if settings.kv_transport == "grpc" else _move_kv_cache_to_shared_memory(async_engine)
    receiver = KvReceiver(async_engine.engine.model_runner.kv_caches, in_shared_memory=shared is not None)
    servicer = DecodeServicer(async_engine, receiver, settings.kv_timeout_s, shared, host_id())
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    KvTransferServicer(receiver).add_to_server(server)
    return servicer


def _move_kv_cache_to_shared_memory(async_engine: AsyncEngine) -> SharedKvCache:
    """Same-host prefill nodes then write pages straight into the reserved blocks. Done before
    the engine serves anything, so the (empty) private cache is simply replaced."""
    runner = async_engine.engine.model_runner
    k = runner.kv_caches[0][0]
    shared = SharedKvCache(len(runner.kv_caches), *k.shape, k.dtype)
    runner.kv_caches = shared.kv_caches
    return shared


def run_decode_node(settings: NodeSettings, role: str = "decode") -> None:
    serve_node(role, settings, add_decode_servicers)
