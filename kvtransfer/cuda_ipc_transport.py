"""Same-host KV transfer between GPU nodes through CUDA IPC: pages go device to device.

The decode node exports the memory of its KV cache (one tensor for every layer) with CUDA IPC.
The handle, the GPU's UUID and the tensor's geometry travel in the GetReservation answer, with
the host id and cache layout the shared-memory path already sends. A prefill node on the same
host opens the handle once, if it can see that GPU, and from then on works like the CPU's
shared-memory path (shm_transport.py):
  - each layer's pages are copied straight into the reserved blocks as soon as the layer is
    computed, on the engine's stream, so a copy runs after the kernels that wrote its pages;
  - before the commit, the sender waits on an event recorded after the last copy, so the
    decode node never reads a page that has not landed;
  - then the commit goes alone over gRPC.
Anything else (another host, a GPU this process cannot see, another layout, a CPU cache) goes
to the inner sender: shared memory or the gRPC stream.

Exporting and opening the handle live in cuda_ipc.py.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from kvtransfer.base import KvCommit, KvDestination, KvSender, KvStream, LeaseRenewal, TransferError, copy_blocks
from kvtransfer.cuda_ipc import open_kv_caches
from kvtransfer.shm_transport import host_id, kv_layout

logger = logging.getLogger(__name__)


class CudaIpcKvSender(KvSender):
    """Writes pages into a same-host decode node's GPU cache; anything else goes to `inner`.
    Mutates the receiver's reserved blocks (and nothing else) through the opened handle."""

    def __init__(self, inner: KvSender, require: bool = False) -> None:
        self.inner = inner  # shared memory or the gRPC stream; its gRPC sender carries the commits
        self.require = require  # --kv-transport cuda_ipc: refuse to fall back
        self._opened: dict[bytes, list | None] = {}

    def open_stream(self, destination: KvDestination, kv_caches, request_id: str) -> KvStream:
        target = self._target(destination, kv_caches)
        if target is not None:
            return CudaIpcKvStream(self, destination, kv_caches, target)
        if self.require:
            raise TransferError(f"decode node {destination.address} offers no CUDA IPC KV cache this GPU can reach")
        return self.inner.open_stream(destination, kv_caches, request_id)

    def _target(self, destination: KvDestination, kv_caches):
        """The decode node's cache as tensors here, when the pages can go device to device."""
        if not destination.cuda_ipc_handle or not kv_caches[0][0].is_cuda:
            return None
        if destination.host_id != host_id() or destination.kv_layout != kv_layout(kv_caches):
            return None
        if destination.cuda_ipc_handle not in self._opened:  # once per decode node's cache
            try:
                self._opened[destination.cuda_ipc_handle] = open_kv_caches(
                    destination.cuda_ipc_handle, destination.kv_layout
                )
            except (RuntimeError, ValueError, KeyError) as error:
                logger.warning("cannot open %s's CUDA IPC handle: %s", destination.address, error)
                self._opened[destination.cuda_ipc_handle] = None
        return self._opened[destination.cuda_ipc_handle]

    async def get_reservation(self, address: str, token: str, timeout_s: float) -> KvDestination:
        return await self.inner.get_reservation(address, token, timeout_s)

    async def renew_leases(self, address: str, request_ids: list[str], timeout_s: float) -> LeaseRenewal:
        return await self.inner.renew_leases(address, request_ids, timeout_s)

    async def commit(self, destination: KvDestination, commit: KvCommit) -> None:
        await self.inner.commit(destination, commit)

    async def close(self) -> None:
        self._opened.clear()
        await self.inner.close()


class CudaIpcKvStream(KvStream):
    """Each layer's pages are copied device to device into the decode node's blocks."""

    def __init__(self, sender: CudaIpcKvSender, destination: KvDestination, kv_caches, target) -> None:
        self.sender = sender
        self.destination = destination
        self.kv_caches = kv_caches
        self.target = target
        self.copied: torch.cuda.Event | None = None
        self.error = ""

    def send_layer(self, layer: int, block_ids: list[int]) -> None:
        if len(block_ids) != len(self.destination.block_ids):
            self.error = f"layer {layer}: {len(block_ids)} blocks to send, {len(self.destination.block_ids)} reserved"
            raise TransferError(self.error)
        for kind in (0, 1):
            copy_blocks(self.kv_caches[layer][kind], self.target[layer][kind], block_ids, self.destination.block_ids)
        if self.kv_caches[layer][0].is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()  # on the engine's stream, after this layer's copies

    async def commit(self, commit: KvCommit) -> None:
        if self.error:
            raise TransferError(self.error)
        if self.copied is not None:
            await asyncio.to_thread(self.copied.synchronize)  # the pages have landed before the commit says so
        in_place = KvCommit(commit.request_id, commit.first_token_id, commit.first_logprob, True)
        await self.sender.commit(self.destination, in_place)

    def cancel(self) -> None:
        pass  # nothing in flight: the decode node frees its reservation when the gateway cancels
