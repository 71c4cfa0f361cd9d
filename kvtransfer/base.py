"""The KV transfer interface: what a sender pushes and how a receiver checks and stores it.

Every transfer is named by its reservation token (`new_reservation_token`), which the decode
node hands out with the reservation and nobody can guess: pages, commits and renewals that name
anything else are refused, and the sender learns the block ids and shared-memory segment from
the decode node (`reservation`), never from its caller.

Lifecycle of one request's transfer, as the receiver sees it:
  1. `reserve(token, block_ids)`           PENDING: the decode engine holds the blocks, under a
                                           lease of `lease_s`
  *  `renew([request_id, ...])`            the prefill node still has the prompt (queued or
                                           being computed): the lease runs `lease_s` from now
  2. `receive_page(page)` for each page    TRANSFERRING: every page is checked against the
                                           reservation, then written straight into the blocks
  3. `commit(token, first_token)`          DONE when every page arrived (in shared memory: every
                                           block's first slot was written), else FAILED
  any check failing, or the lease expiring FAILED with a reason; other requests are unaffected
The decode service awaits `wait(request_id)` and then admits (or aborts) the request; `forget`
drops the reservation, and the next renewal tells the prefill node it was released.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# Received pages are read-only buffers, only ever read: one filter is cheaper than catch_warnings().
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default limit; one page message stays below it
KEY, VALUE = 0, 1
DEFAULT_LEASE_S = 10.0  # KvTransferOptions.kv_lease_s's default


class TransferStatus(enum.IntEnum):
    """Ordered: DONE and FAILED are final."""

    PENDING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3


@dataclass(frozen=True)
class KvPage:
    """`num_blocks` consecutive blocks of one layer's K or V, from `block_index` in the
    request's block list; `data` is their raw bytes, [num_blocks, block_size, heads, dim]."""

    request_id: str
    layer: int
    kind: int  # KEY or VALUE
    block_index: int
    num_blocks: int
    dtype: str
    data: bytes | memoryview  # from iter_pages: a view of the sender's cache, valid while its blocks are held


@dataclass(frozen=True)
class KvCommit:
    request_id: str
    first_token_id: int
    first_logprob: object | None = None  # pdserve.engine.request.TokenLogprob
    pages_in_shared_memory: bool = False  # the sender wrote the pages straight into our cache


@dataclass(frozen=True)
class KvDestination:
    """Where a request's pages go: the decode node's address and, for a same-host
    shared-memory transfer, its reservation (block ids, segment name, host id, layout)."""

    address: str
    block_ids: tuple[int, ...] = ()
    shm_name: str = ""
    host_id: str = ""
    kv_layout: str = ""
    num_cached_blocks: int = 0  # the prompt's leading blocks the decode node holds already: not sent
    cuda_ipc_handle: bytes = b""  # a GPU decode node's exported cache (cuda_ipc_transport.py)


@dataclass(frozen=True)
class KvTransferStats:
    """A node's KV transfer counters since it started: the receiver's (decode) and the sender's
    (prefill); the registry's stats and the node's /metrics read them."""

    num_blocks_received: int = 0  # committed blocks, by either transport
    num_bytes_received: int = 0  # page bytes that came over the gRPC stream
    num_commits_received: int = 0  # transfers committed here
    num_pushes: int = 0  # transfers this node pushed that ended (committed or failed)
    num_push_failures: int = 0
    push_seconds: float = 0.0  # summed over pushes: last layer computed -> commit answered


@dataclass(frozen=True)
class LeaseRenewal:
    """A decode node's answer to a renewal: the requests it no longer holds blocks for, and its
    lease period (the sender renews well within it)."""

    released_request_ids: list[str]
    lease_s: float


class TransferError(Exception):
    """A transfer failed; the message says why."""


def new_reservation_token() -> str:
    """A random name for one reservation (128 bits): only whoever was handed it can use it."""
    return secrets.token_urlsafe(16)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# KV cache dtypes a node may hold (--kv-cache-dtype); a page of one fits a cache of another, converted.
PAGE_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16")}


def contiguous_runs(source_ids, target_ids) -> list[tuple[int, int, int]]:
    """(source start, target start, length) of runs where both id lists count up by one, so a
    run is copied as one slice (a memcpy) instead of gathered block by block."""
    runs: list[tuple[int, int, int]] = []
    for s, t in zip(source_ids, target_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and t == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, t, 1))
    return runs


def copy_blocks(source: torch.Tensor, target: torch.Tensor, source_ids, target_ids, non_blocking: bool = False) -> None:
    """target[target_ids] = source[source_ids], one slice copy per contiguous run."""
    for s, t, n in contiguous_runs(source_ids, target_ids):
        target[t : t + n].copy_(source[s : s + n], non_blocking=non_blocking)


def iter_pages(
    kv_caches, request_id: str, block_ids: list[int], max_bytes: int = MAX_MESSAGE_BYTES, layers: range | None = None
) -> Iterator[KvPage]:
    """Reads a request's blocks layer by layer, K then V, in messages of at most max_bytes."""
    per_page = pages_per_message(kv_caches[0][0], max_bytes)
    for layer in layers if layers is not None else range(len(kv_caches)):
        for kind, cache in ((KEY, kv_caches[layer][0]), (VALUE, kv_caches[layer][1])):
            for start in range(0, len(block_ids), per_page):
                blocks = _gather(cache, block_ids[start : start + per_page])
                yield _page(request_id, layer, kind, start, blocks)


def pages_of_blocks(request_id: str, layer: int, kind: int, blocks: torch.Tensor, max_bytes: int) -> list[KvPage]:
    """Pages over blocks already gathered in host memory, in request order (host_staging.py)."""
    per_page = pages_per_message(blocks, max_bytes)
    return [
        _page(request_id, layer, kind, start, blocks[start : start + per_page])
        for start in range(0, blocks.shape[0], per_page)
    ]


def pages_per_message(cache: torch.Tensor, max_bytes: int) -> int:
    block_bytes = cache[0].numel() * cache.element_size()
    return max(1, (max_bytes - 1024) // block_bytes)  # leave room for the header fields


def _page(request_id: str, layer: int, kind: int, block_index: int, blocks: torch.Tensor) -> KvPage:
    data = memoryview(blocks.contiguous().view(torch.uint8).numpy()).cast("B")  # no copy for a run
    return KvPage(request_id, layer, kind, block_index, blocks.shape[0], dtype_name(blocks.dtype), data)


def _gather(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The blocks in order; a view (no copy) when their ids are consecutive."""
    first = block_ids[0]
    if block_ids == list(range(first, first + len(block_ids))):
        return cache[first : first + len(block_ids)]
    return cache.index_select(0, torch.tensor(block_ids, dtype=torch.long))


@dataclass
class _Reservation:
    block_ids: list[int]
    num_cached_blocks: int = 0
    status: TransferStatus = TransferStatus.PENDING
    reason: str = ""
    received: set[tuple[int, int, int]] = field(default_factory=set)  # (layer, kind, block index)
    commit: KvCommit | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    expires_at: float = 0.0  # time.monotonic(): moved on by every renewal and page


class KvReceiver:
    """Checks incoming pages against reservations and writes them into the KV caches.

    Mutates the given per-layer caches (only the reserved blocks) and its reservations. Used
    from one event loop; every transport feeds it the same way. A reservation lives `lease_s`
    after it was made, renewed or last sent a page: its prefill node renews it while the prompt
    waits there, so a long queue never fails it, and a gone prefill node frees it."""

    def __init__(self, kv_caches, in_shared_memory: bool = False, lease_s: float = DEFAULT_LEASE_S) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.kv_caches = kv_caches
        self.lease_s = lease_s
        self.in_shared_memory = in_shared_memory  # senders on this host may write pages directly
        self.num_layers = len(kv_caches)
        sample = kv_caches[0][0]
        self.block_shape = tuple(sample.shape[1:])
        self.block_numel = sample[0].numel()
        self.dtype = sample.dtype
        self.reservations: dict[str, _Reservation] = {}
        self.num_bytes_received = 0  # over the gRPC stream
        self.num_blocks_received = 0  # committed blocks, by either transport
        self.num_commits_received = 0

    def stats(self) -> KvTransferStats:
        return KvTransferStats(self.num_blocks_received, self.num_bytes_received, self.num_commits_received)

    def reserve(self, token: str, block_ids: list[int], num_cached_blocks: int = 0) -> None:
        """Holds the blocks under `token` (from `new_reservation_token`). In shared memory,
        where senders write without telling us, each block's first slot is zeroed: a commit is
        accepted only once the sender has overwritten every one of them (`_written_in_place`),
        so a commit without pages never admits stale KV of an earlier request."""
        if self.in_shared_memory:
            index = torch.tensor(block_ids, dtype=torch.long)
            for layer in self.kv_caches:
                for cache in layer:
                    cache[index, 0] = 0
        expires_at = time.monotonic() + self.lease_s
        self.reservations[token] = _Reservation(list(block_ids), num_cached_blocks, expires_at=expires_at)

    def reservation(self, token: str) -> tuple[list[int], int]:
        """The open reservation's block ids and number of cached leading blocks; raises
        TransferError for a token this receiver does not hold open."""
        reservation = self._open_reservation(token)
        return list(reservation.block_ids), reservation.num_cached_blocks

    def renew(self, request_ids) -> LeaseRenewal:
        """Extends the leases of the open reservations among `request_ids`; names the others
        (forgotten, failed or never made here), whose prompts nobody waits for any more."""
        released = []
        expires_at = time.monotonic() + self.lease_s
        for request_id in request_ids:
            reservation = self.reservations.get(request_id)
            if reservation is None or reservation.status == TransferStatus.FAILED:
                released.append(request_id)
            else:
                reservation.expires_at = max(reservation.expires_at, expires_at)
        return LeaseRenewal(released, self.lease_s)

    def status(self, request_id: str) -> TransferStatus | None:
        reservation = self.reservations.get(request_id)
        return reservation.status if reservation else None

    def receive_page(self, page: KvPage) -> None:
        """Stores one page; raises TransferError (and fails the request) if it does not fit."""
        reservation = self._open_reservation(page.request_id)
        error = self._check(page, reservation)
        if error:
            self.fail(page.request_id, error)
            raise TransferError(error)
        target = reservation.block_ids[page.block_index : page.block_index + page.num_blocks]
        data = torch.frombuffer(page.data, dtype=PAGE_DTYPES[page.dtype]).view(page.num_blocks, *self.block_shape)
        # A page of another dtype is rounded as the node rounds the K/V it computes itself (copy_).
        copy_blocks(data, self.kv_caches[page.layer][page.kind], range(page.num_blocks), target)
        for i in range(page.block_index, page.block_index + page.num_blocks):
            reservation.received.add((page.layer, page.kind, i))
        reservation.status = TransferStatus.TRANSFERRING
        reservation.expires_at = time.monotonic() + self.lease_s  # pages arriving: the sender is alive
        self.num_bytes_received += len(page.data)

    def commit(self, commit: KvCommit) -> None:
        reservation = self._open_reservation(commit.request_id)
        expected = self.num_layers * 2 * len(reservation.block_ids)
        in_place = commit.pages_in_shared_memory and self.in_shared_memory and not reservation.received
        if in_place and self._written_in_place(reservation.block_ids):
            reservation.received = {(0, 0, i) for i in range(expected)}
        if len(reservation.received) != expected:
            error = f"request {commit.request_id}: commit after {len(reservation.received)} of {expected} blocks"
            self.fail(commit.request_id, error)
            raise TransferError(error)
        reservation.commit = commit
        reservation.status = TransferStatus.DONE
        self.num_blocks_received += len(reservation.block_ids)
        self.num_commits_received += 1
        reservation.done.set()

    def fail(self, request_id: str, reason: str) -> None:
        reservation = self.reservations.get(request_id)
        if reservation is not None and reservation.status < TransferStatus.DONE:
            reservation.status = TransferStatus.FAILED
            reservation.reason = reason
            reservation.done.set()

    async def wait(self, request_id: str) -> KvCommit:
        """The commit once every page is in, however long that takes while the lease is renewed;
        raises TransferError when the transfer failed or the lease expired."""
        reservation = self.reservations[request_id]
        while not reservation.done.is_set():
            remaining = reservation.expires_at - time.monotonic()
            if remaining <= 0:
                reason = f"request {request_id}: lease expired ({self.lease_s:.1f} s without a renewal)"
                self.fail(request_id, reason)
                break
            try:
                await asyncio.wait_for(reservation.done.wait(), remaining)
            except TimeoutError:
                continue  # renewed meanwhile, or expired: the loop decides
        if reservation.status == TransferStatus.FAILED:
            raise TransferError(reservation.reason)
        return reservation.commit

    def forget(self, request_id: str) -> None:
        self.reservations.pop(request_id, None)

    def _written_in_place(self, block_ids: list[int]) -> bool:
        """Whether every layer's K and V of every block has a non-zero first slot. Real K/V
        vectors are never exactly all zero; the ones `reserve` zeroed stay so until written."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return all(
            bool(cache[index, 0].flatten(1).ne(0).any(dim=1).all()) for layer in self.kv_caches for cache in layer
        )

    def _open_reservation(self, request_id: str) -> _Reservation:
        reservation = self.reservations.get(request_id)
        if reservation is None:
            raise TransferError(f"unknown request {request_id!r}: no blocks are reserved for it")
        if reservation.status >= TransferStatus.DONE:
            raise TransferError(f"request {request_id}: transfer already {reservation.status.name.lower()}")
        return reservation

    def _check(self, page: KvPage, reservation: _Reservation) -> str:
        where = f"request {page.request_id}, layer {page.layer}, blocks {page.block_index}+{page.num_blocks}"
        if not 0 <= page.layer < self.num_layers or page.kind not in (KEY, VALUE):
            return f"{where}: no such layer/kind (model has {self.num_layers} layers)"
        if (
            page.num_blocks < 1
            or page.block_index < 0
            or page.block_index + page.num_blocks > len(reservation.block_ids)
        ):
            return f"{where}: outside the {len(reservation.block_ids)} reserved blocks"
        if page.dtype not in PAGE_DTYPES:
            return f"{where}: dtype {page.dtype!r}, expected one of {', '.join(PAGE_DTYPES)}"
        expected_bytes = page.num_blocks * self.block_numel * PAGE_DTYPES[page.dtype].itemsize
        if len(page.data) != expected_bytes:
            return f"{where}: {len(page.data)} bytes, expected {expected_bytes} ({page.dtype})"
        if any(
            (page.layer, page.kind, i) in reservation.received
            for i in range(page.block_index, page.block_index + page.num_blocks)
        ):
            return f"{where}: duplicate page"
        return ""


class KvStream(ABC):
    """One request's layer-wise push: pages go out as each layer is computed, then the commit.

    `send_layer` runs on the engine thread between two layers (it must only copy and hand
    off); `commit` and `cancel` run on the event loop."""

    @abstractmethod
    def send_layer(self, layer: int, block_ids: list[int]) -> None:
        """Ships this layer's pages of the request's blocks (computed and final)."""

    @abstractmethod
    async def commit(self, commit: KvCommit) -> None:
        """Ends the stream once every layer was sent; raises TransferError."""

    @abstractmethod
    def cancel(self) -> None:
        """Drops the stream (the request ended before its pages were needed)."""


class KvSender(ABC):
    """Opens one `KvStream` per request to a decode node: its pages go out layer by layer, then
    the commit with the first token."""

    @abstractmethod
    def open_stream(self, destination: KvDestination, kv_caches, request_id: str) -> KvStream:
        """A layer-wise push, opened before the prefill forward pass runs (on the event loop);
        raises TransferError if the destination cannot be reached this way."""

    @abstractmethod
    async def get_reservation(self, address: str, token: str, timeout_s: float) -> KvDestination:
        """Where the pages of the reservation `token` go, as the decode node at `address`
        answers (block ids, cached blocks, its shared-memory segment); raises TransferError if
        it holds no such reservation or cannot be reached."""

    @abstractmethod
    async def renew_leases(self, address: str, request_ids: list[str], timeout_s: float) -> LeaseRenewal:
        """Renews the decode node's reservations for these requests in one call; raises
        TransferError if the node cannot be reached within timeout_s."""

    @abstractmethod
    async def close(self) -> None:
        """Releases the transport's channels and mappings."""
