"""The decode role for the node runtime (`pdserve decode` and `pdserve colocated`).

A decode node on CPU keeps its KV cache in a shared-memory segment, and one on a GPU exports its
cache with CUDA IPC (unless `--kv-transport grpc`), so same-host prefill nodes write pages
straight into the reserved blocks; other hosts push pages over the gRPC KV stream. A colocated
node is a decode node whose requests all ask for `local_prefill`: prefill and decode share one
engine and one continuous batch, no KV transfer.

The gateway reads a request's tokens from the node's token stream (token_stream_server.py) where
the node serves one (`--token-stream-port`, on unless -1), and from the gRPC Generate stream
otherwise: both run the same servicer."""

from __future__ import annotations

import ssl

import grpc
import torch

from decode_service.servicer import DecodeServicer
from decode_service.token_stream_server import TokenStreamServer
from kvtransfer.base import KvReceiver, KvTransferStats
from kvtransfer.cuda_ipc import export_kv_cache
from kvtransfer.grpc_transport import KvTransferServicer
from kvtransfer.shm_transport import SharedKvCache, host_id, kv_layout
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_cache import KvCacheSpec, stacked_view
from protos import decode_pb2_grpc


class SharedMemoryKvStorage:
    """Implements pdserve.engine.kv_cache.KvCacheStorage: the KV cache in a new shared-memory
    segment, which this node unlinks when it stops."""

    def __init__(self) -> None:
        self.segment: SharedKvCache | None = None

    def allocate(self, spec: KvCacheSpec) -> torch.Tensor:
        if spec.device != "cpu":
            raise ValueError(
                f"a shared-memory KV cache lives in host memory, not on {spec.device}: use --kv-transport grpc"
            )
        self.segment = SharedKvCache(
            spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype
        )
        return stacked_view(self.segment.kv_caches)


class DecodeNodeService:
    """Implements pdserve.node.NodeService for decode and colocated nodes."""

    layer_hook = None

    def __init__(
        self,
        kv_transport: str,
        kv_lease_s: float,
        max_reserve_wait_s: float,
        colocated: bool = False,
        device: str = "cpu",
        stream_interval: int = 1,
        token_stream_port: int = -1,
        secret: str | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.kv_lease_s = kv_lease_s
        self.stream_interval = stream_interval
        self.max_reserve_wait_s = max_reserve_wait_s
        if kv_transport == "cuda_ipc" and device == "cpu":
            raise ValueError("--kv-transport cuda_ipc moves pages between GPUs: use it with --device cuda")
        # auto: shared memory where the cache lives in host memory; a GPU cache is exported with CUDA IPC.
        shared = not colocated and (kv_transport == "shm" or (kv_transport == "auto" and device == "cpu"))
        self.kv_storage = SharedMemoryKvStorage() if shared else None
        self.exports_cuda_ipc = not colocated and device != "cpu" and kv_transport in ("auto", "cuda_ipc")
        self._receiver: KvReceiver | None = None
        self.token_stream_port = token_stream_port
        self._token_stream_secret = secret
        self._token_stream_ssl = server_ssl_context
        self.token_stream: TokenStreamServer | None = None

    def add_to_server(self, server: grpc.aio.Server, async_engine: AsyncEngine) -> None:
        segment = self.kv_storage.segment if self.kv_storage is not None else None
        kv_caches = async_engine.engine.kv_caches
        ipc_handle = export_kv_cache(stacked_view(kv_caches)) if self.exports_cuda_ipc else b""
        in_place = segment is not None or bool(ipc_handle)  # same-host senders write pages directly
        self._receiver = KvReceiver(kv_caches, in_shared_memory=in_place, lease_s=self.kv_lease_s)
        servicer = DecodeServicer(async_engine, self._receiver, self.max_reserve_wait_s, self.stream_interval)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        if self.token_stream_port >= 0:
            self.token_stream = TokenStreamServer(servicer, self._token_stream_secret, self._token_stream_ssl)
        if segment is not None:
            shared_kv = (segment.name, host_id(), segment.layout)
        elif ipc_handle:
            shared_kv = ("", host_id(), kv_layout(kv_caches))
        else:
            shared_kv = ("", "", "")
        KvTransferServicer(self._receiver, shared_kv, ipc_handle).add_to_server(server)

    async def start_token_stream(self, host: str) -> int | None:
        if self.token_stream is None:
            return None
        return await self.token_stream.start(host, self.token_stream_port)

    async def stop_token_stream(self, grace_s: float) -> None:
        if self.token_stream is not None:
            await self.token_stream.stop(grace_s)

    def kv_transfer_stats(self) -> KvTransferStats:
        return self._receiver.stats() if self._receiver is not None else KvTransferStats()

    async def close(self) -> None:
        if self.kv_storage is not None and self.kv_storage.segment is not None:
            self.kv_storage.segment.unlink()
