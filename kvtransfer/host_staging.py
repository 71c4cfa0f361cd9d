"""Pages of a GPU KV cache on their way to the gRPC stream: copied to pinned host memory on a
side stream, so the copy overlaps the layers still being computed.

The gRPC stream sends bytes from host memory. Reading a GPU cache there directly would stall
the engine thread on every layer (a synchronous device-to-host copy into pageable memory), and
the next layer's kernels would wait for it. Instead, when the engine has computed a layer:
  1. `stage` (engine thread): the copy stream waits for the kernels queued so far (they wrote
     the layer's pages), then copies each run of the request's blocks into a pinned buffer
     without blocking; an event marks the end. The engine queues its next layer at once;
  2. `StagedLayer.wait` (event loop): a worker thread waits on the event;
  3. `StagedLayer.pages`, then encoding, copies the bytes into the messages, and
     `StagedLayer.release` hands the pinned buffers back for the next layer.
The request's blocks stay held until its push commits, so nothing overwrites them meanwhile.

Why pinned buffers and not NCCL across hosts (as vLLM's P2pNcclConnector does): the gRPC
stream already carries leases, reservation checks, TLS and the cluster secret, and reaches any
node without a collective group set up per prefill-decode pair; pinned staging removes the
stall that made it slow on a GPU. A CPU cache (tests) takes the same path with plain buffers.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from kvtransfer.base import KEY, VALUE, KvPage, copy_blocks, pages_of_blocks

MAX_POOLED_BYTES = 256 << 20  # pinned memory kept for reuse; pinning is slow, so it is kept


class PinnedBufferPool:
    """Host buffers by size class (powers of two), reused across layers and requests: pinning
    memory costs far more than copying into it. Thread-safe: the engine thread takes buffers,
    the event loop gives them back."""

    def __init__(self, pin_memory: bool, max_pooled_bytes: int = MAX_POOLED_BYTES) -> None:
        self.pin_memory = pin_memory
        self.max_pooled_bytes = max_pooled_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pooled_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            if self._free[size]:
                self._pooled_bytes -= size
                return self._free[size].pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._pooled_bytes + buffer.numel() <= self.max_pooled_bytes:
                self._free[buffer.numel()].append(buffer)
                self._pooled_bytes += buffer.numel()


@dataclass
class StagedLayer:
    """One layer's K and V blocks of a request, in host buffers (ready once `copied` has fired)."""

    request_id: str
    layer: int
    blocks: tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, *block_shape] views of `buffers`
    buffers: list[torch.Tensor]
    pool: PinnedBufferPool
    copied: torch.cuda.Event | None = None
    released: bool = False

    async def wait(self) -> None:
        if self.copied is not None and not self.copied.query():
            await asyncio.to_thread(self.copied.synchronize)

    def pages(self, max_bytes: int) -> list[KvPage]:
        pages = []
        for kind in (KEY, VALUE):
            pages += pages_of_blocks(self.request_id, self.layer, kind, self.blocks[kind], max_bytes)
        return pages

    def release(self) -> None:
        """Hands the buffers back; only once the pages' bytes are copied into messages."""
        if not self.released:
            self.released = True
            for buffer in self.buffers:
                self.pool.give(buffer)


class HostStaging:
    """Stages layers of one device's KV cache into host buffers; one copy stream per device."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.pool = PinnedBufferPool(pin_memory=on_gpu)
        self.copy_stream = torch.cuda.Stream(self.device) if on_gpu else None

    def stage(self, kv_caches, request_id: str, layer: int, block_ids: list[int]) -> StagedLayer:
        """Starts copying `block_ids` of `layer` to host memory; returns at once on a GPU."""
        buffers, blocks = [], []
        for cache in kv_caches[layer]:
            nbytes = len(block_ids) * cache[0].numel() * cache.element_size()
            buffers.append(self.pool.take(nbytes))
            blocks.append(buffers[-1][:nbytes].view(cache.dtype).view(len(block_ids), *cache.shape[1:]))
        if self.copy_stream is None:
            _copy_layer(kv_caches[layer], blocks, block_ids)
            return StagedLayer(request_id, layer, (blocks[0], blocks[1]), buffers, self.pool)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the layer's pages are written
        with torch.cuda.stream(self.copy_stream):
            _copy_layer(kv_caches[layer], blocks, block_ids, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        return StagedLayer(request_id, layer, (blocks[0], blocks[1]), buffers, self.pool, copied)


def _copy_layer(layer_caches, host_blocks, block_ids: list[int], non_blocking: bool = False) -> None:
    """host_blocks[kind][i] = cache[kind][block_ids[i]] for K and V."""
    for cache, host in zip(layer_caches, host_blocks):
        copy_blocks(cache, host, block_ids, range(len(block_ids)), non_blocking)
