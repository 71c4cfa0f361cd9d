"""In-process transport for unit tests: pages go straight to a receiver, no network."""

from __future__ import annotations

import asyncio

from kvtransfer.base import (
    KvCommit,
    KvDestination,
    KvReceiver,
    KvSender,
    KvStream,
    LeaseRenewal,
    TransferError,
    iter_pages,
)


class FakeKvSender(KvSender):
    """Delivers to the receiver registered under the address; mutates that receiver."""

    def __init__(self, receivers: dict[str, KvReceiver], max_page_bytes: int = 1 << 20) -> None:
        self.receivers = receivers
        self.max_page_bytes = max_page_bytes
        self.num_pages_sent = 0
        self.num_renewals = 0
        self.unreachable: set[str] = set()  # addresses whose node is "down": renewals fail

    def open_stream(self, destination: KvDestination, kv_caches, request_id: str) -> FakeKvStream:
        return FakeKvStream(self, self.receivers[destination.address], kv_caches, request_id)

    async def get_reservation(self, address: str, token: str, timeout_s: float) -> KvDestination:
        if address not in self.receivers:
            raise TransferError(f"reservation at {address}: UNAVAILABLE")
        block_ids, num_cached_blocks = self.receivers[address].reservation(token)
        return KvDestination(address, tuple(block_ids), num_cached_blocks=num_cached_blocks)

    async def renew_leases(self, address: str, request_ids: list[str], timeout_s: float) -> LeaseRenewal:
        if address in self.unreachable:
            raise TransferError(f"renewal at {address} failed: UNAVAILABLE")
        self.num_renewals += 1
        return self.receivers[address].renew(request_ids)

    async def close(self) -> None:
        pass  # no channels or mappings


class FakeKvStream(KvStream):
    """Hands each layer's pages to the receiver on the event loop (receivers are not thread-safe)."""

    def __init__(self, sender: FakeKvSender, receiver: KvReceiver, kv_caches, request_id: str) -> None:
        self.sender, self.receiver, self.kv_caches, self.request_id = sender, receiver, kv_caches, request_id
        self.loop = asyncio.get_running_loop()

    def send_layer(self, layer: int, block_ids: list[int]) -> None:
        pages = list(
            iter_pages(self.kv_caches, self.request_id, block_ids, self.sender.max_page_bytes, range(layer, layer + 1))
        )
        self.loop.call_soon_threadsafe(self._deliver, pages)

    def _deliver(self, pages) -> None:
        for page in pages:
            try:
                self.receiver.receive_page(page)
            except TransferError:  # the receiver failed the transfer (or knows no such request): commit says so
                return
            self.sender.num_pages_sent += 1

    async def commit(self, commit: KvCommit) -> None:
        await asyncio.sleep(0)  # let queued pages land first
        self.receiver.commit(commit)

    def cancel(self) -> None:
        pass
