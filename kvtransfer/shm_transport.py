"""Same-host KV transfer through shared memory: only metadata crosses gRPC.

The decode node allocates its whole KV cache inside one POSIX shared-memory segment and
names it (with its host id and cache layout) when a prefill node asks for a reservation
(GetReservation). A prefill node on the same host maps that segment, if its name is a pdserve
one (`SEGMENT_PREFIX`), once and copies each page straight into the reserved blocks, one
memcpy per layer and kind, then sends only a commit over the gRPC stream. Nodes on different
hosts, or with a different layout, fall back to the gRPC page stream.
"""

from __future__ import annotations

import logging
import secrets
import socket
from functools import cache
from multiprocessing import resource_tracker, shared_memory

import torch

from kvtransfer.base import (
    KvCommit,
    KvDestination,
    KvSender,
    KvStream,
    LeaseRenewal,
    TransferError,
    copy_blocks,
    dtype_name,
)
from kvtransfer.grpc_transport import GrpcKvSender
from pdserve.engine.kv_cache import kv_caches_over

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "pdserve_kv_"  # a sender attaches to no other segment, whatever a reply names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CREATED_HERE: set[str] = set()  # segments this process owns (and its resource tracker unlinks)


@cache
def host_id() -> str:
    """Identifies this machine (and boot): equal ids mean the two nodes share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def layout_string(num_layers: int, block_shape, dtype: torch.dtype) -> str:
    """ "layers,blocks,block_size,kv_heads,head_dim,dtype": what two caches must share."""
    return ",".join(map(str, (num_layers, *block_shape, dtype_name(dtype))))


def kv_layout(kv_caches) -> str:
    k = kv_caches[0][0]
    return layout_string(len(kv_caches), k.shape, k.dtype)


def _tensors_over(buffer, layout: str):
    num_layers, num_blocks, block_size, heads, dim, dtype_str = layout.split(",")
    shape = (int(num_blocks), int(block_size), int(heads), int(dim))
    dtype = DTYPES[dtype_str]
    count = int(num_layers) * 2 * shape[0] * shape[1] * shape[2] * shape[3]
    return kv_caches_over(torch.frombuffer(buffer, dtype=dtype, count=count).view(int(num_layers), 2, *shape))


class SharedKvCache:
    """Decode side: owns the shared-memory segment holding every layer's K and V blocks."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ):
        self.layout = layout_string(num_layers, (num_blocks, block_size, num_kv_heads, head_dim), dtype)
        nbytes = (
            2
            * num_layers
            * num_blocks
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )
        name = SEGMENT_PREFIX + secrets.token_hex(8)
        self.segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        _CREATED_HERE.add(self.segment.name)
        self.kv_caches = _tensors_over(self.segment.buf, self.layout)
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    @property
    def name(self) -> str:
        return self.segment.name

    def unlink(self) -> None:
        self.segment.unlink()


class ShmKvSender(KvSender):
    """Writes pages into a same-host decode node's shared KV cache; anything else goes over gRPC.
    Mutates the receiver's reserved blocks (and nothing else) through the mapping."""

    def __init__(self, grpc_sender: GrpcKvSender | None = None, require: bool = False) -> None:
        self.grpc_sender = grpc_sender or GrpcKvSender()
        self.require = require  # --kv-transport shm: refuse to fall back to the gRPC stream
        self._mappings: dict[str, tuple[shared_memory.SharedMemory, list]] = {}

    def can_share(self, destination: KvDestination, kv_caches) -> bool:
        return (
            destination.shm_name.startswith(SEGMENT_PREFIX)
            and destination.host_id == host_id()
            and destination.kv_layout == kv_layout(kv_caches)
        )

    def open_stream(self, destination: KvDestination, kv_caches, request_id: str) -> KvStream:
        if self.can_share(destination, kv_caches):
            return ShmKvStream(self, destination, kv_caches)
        if self.require:
            raise TransferError(f"decode node {destination.address} offers no shared-memory KV cache on this host")
        return self.grpc_sender.open_stream(destination, kv_caches, request_id)

    async def get_reservation(self, address: str, token: str, timeout_s: float) -> KvDestination:
        return await self.grpc_sender.get_reservation(address, token, timeout_s)

    async def renew_leases(self, address: str, request_ids: list[str], timeout_s: float) -> LeaseRenewal:
        return await self.grpc_sender.renew_leases(address, request_ids, timeout_s)  # metadata: over gRPC

    async def commit(self, destination: KvDestination, commit: KvCommit) -> None:
        await self.grpc_sender.commit(destination, commit)

    def _attach(self, destination: KvDestination):
        """Maps the decode node's segment (once per segment; cheap afterwards)."""
        if destination.shm_name not in self._mappings:
            segment = shared_memory.SharedMemory(name=destination.shm_name)
            if destination.shm_name not in _CREATED_HERE:
                # The decode node owns the segment: this process must not unlink it at exit.
                resource_tracker.unregister(segment._name, "shared_memory")
            self._mappings[destination.shm_name] = (segment, _tensors_over(segment.buf, destination.kv_layout))
        return self._mappings[destination.shm_name][1]

    async def close(self) -> None:
        await self.grpc_sender.close()


class ShmKvStream(KvStream):
    """Each layer's pages are copied into the decode node's blocks as soon as it is computed."""

    def __init__(self, sender: ShmKvSender, destination: KvDestination, kv_caches) -> None:
        self.sender = sender
        self.destination = destination
        self.kv_caches = kv_caches
        self.target = sender._attach(destination)  # map on the event loop, not between two layers
        self.error = ""  # the receiver cannot count pages written in place: a bad layer fails the commit here

    def send_layer(self, layer: int, block_ids: list[int]) -> None:
        if len(block_ids) != len(self.destination.block_ids):
            self.error = f"layer {layer}: {len(block_ids)} blocks to send, {len(self.destination.block_ids)} reserved"
            raise TransferError(self.error)
        for kind in (0, 1):  # one slice copy per run of consecutive blocks
            copy_blocks(self.kv_caches[layer][kind], self.target[layer][kind], block_ids, self.destination.block_ids)

    async def commit(self, commit: KvCommit) -> None:
        if self.error:
            raise TransferError(self.error)
        shared_commit = KvCommit(commit.request_id, commit.first_token_id, commit.first_logprob, True)
        await self.sender.grpc_sender.commit(self.destination, shared_commit)

    def cancel(self) -> None:
        pass  # nothing in flight: the decode node frees its reservation when the gateway cancels
