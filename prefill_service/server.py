"""The prefill role for the node runtime (`pdserve prefill`): the engine keeps its KV cache in
local memory and calls `KvPushes.on_layer_computed` after each layer, so a prompt's pages leave
for the decode node while the rest of the forward pass runs; a `LeaseKeeper` renews the decode
nodes' reservations while the prompts wait here."""

from __future__ import annotations

import grpc

from kvtransfer.base import KvSender, KvTransferStats
from kvtransfer.cuda_ipc_transport import CudaIpcKvSender
from kvtransfer.grpc_transport import GrpcKvSender
from kvtransfer.lease_keeper import LeaseKeeper
from kvtransfer.shm_transport import ShmKvSender
from pdserve.cluster_state.registry import RegistryView
from pdserve.cluster_state.secret import client_interceptors
from pdserve.engine.async_engine import AsyncEngine
from prefill_service.servicer import KvPushes, PrefillServicer
from protos import prefill_pb2_grpc


class RegisteredDecodeNodes:
    """Implements prefill_service.servicer.DecodeNodeDirectory over the registry (signed entries
    only, with a cluster secret). Started on first use; an address not in the snapshot is looked
    up again once (a decode node that registered since the last refresh)."""

    def __init__(self, redis_url: str, cluster_secret: str | None) -> None:
        self.view = RegistryView(redis_url, secret=cluster_secret)
        self._started = False

    async def is_decode_node(self, address: str) -> bool:
        if not self._started:
            self._started = True
            await self.view.start()
        if not self._known(address):
            await self.view.refresh()
        return self._known(address)

    def _known(self, address: str) -> bool:
        # A draining decode node still awaits the pages of the requests it reserved for.
        return any(node.address == address for node in self.view.nodes("decode", include_draining=True))

    async def close(self) -> None:
        await self.view.stop()


class PrefillNodeService:
    """Implements pdserve.node.NodeService for prefill nodes."""

    kv_storage = None  # local memory

    def __init__(
        self,
        kv_transport: str,
        kv_lease_s: float,
        cluster_secret: str | None = None,
        redis_url: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.kv_transport = kv_transport  # auto | grpc | shm
        self.kv_lease_s = kv_lease_s  # until a decode node states its own lease period
        self.cluster_secret = cluster_secret  # carried by every call to a decode node
        self.credentials = credentials  # TLS to decode nodes; None: plaintext
        # The decode nodes it may dial: those registered in the cluster's Redis.
        self.decode_nodes = RegisteredDecodeNodes(redis_url, cluster_secret) if redis_url else None
        self.pushes = KvPushes()
        self.layer_hook = self.pushes.on_layer_computed
        self._sender: KvSender | None = None
        self._servicer: PrefillServicer | None = None

    def add_to_server(self, server: grpc.aio.Server, async_engine: AsyncEngine) -> None:
        grpc_sender = GrpcKvSender(client_interceptors(self.cluster_secret), self.credentials)
        self._sender = kv_sender(self.kv_transport, grpc_sender)
        leases = LeaseKeeper(self._sender, self.kv_lease_s)
        self._servicer = PrefillServicer(async_engine, self._sender, self.pushes, leases, self.decode_nodes)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self._servicer, server)

    async def start_token_stream(self, host: str) -> int | None:
        return None  # tokens stream from decode nodes only

    async def stop_token_stream(self, grace_s: float) -> None:
        pass

    def kv_transfer_stats(self) -> KvTransferStats:
        # A prefill node receives no pages: only its pushes count.
        servicer = self._servicer
        if servicer is None:
            return KvTransferStats()
        return KvTransferStats(
            num_pushes=servicer.num_pushes,
            num_push_failures=servicer.num_push_failures,
            push_seconds=servicer.push_seconds,
        )

    async def close(self) -> None:
        await self._servicer.close()
        if self.decode_nodes is not None:
            await self.decode_nodes.close()


def kv_sender(kv_transport: str, grpc_sender: GrpcKvSender) -> KvSender:
    """The sender for --kv-transport. auto: device to device (CUDA IPC) when the decode node's
    cache is on a GPU this process sees, shared memory when it is in this host's memory, else
    the gRPC stream; shm and cuda_ipc: that path or an error; grpc: always the stream."""
    if kv_transport == "grpc":
        return grpc_sender
    if kv_transport == "shm":
        return ShmKvSender(grpc_sender, require=True)
    if kv_transport == "cuda_ipc":
        return CudaIpcKvSender(grpc_sender, require=True)
    return CudaIpcKvSender(ShmKvSender(grpc_sender))
