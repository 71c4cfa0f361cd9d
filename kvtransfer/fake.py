"""In-process transport for unit tests: pages go straight to a receiver, no network."""

from __future__ import annotations

from kvtransfer.base import KvCommit, KvDestination, KvReceiver, KvSender, iter_pages


class FakeKvSender(KvSender):
    """Delivers to the receiver registered under the address; mutates that receiver."""

    def __init__(self, receivers: dict[str, KvReceiver], max_page_bytes: int = 1 << 20) -> None:
        self.receivers = receivers
        self.max_page_bytes = max_page_bytes
        self.num_pages_sent = 0

    async def send(self, destination: KvDestination, kv_caches, block_ids: list[int], commit: KvCommit) -> None:
        receiver = self.receivers[destination.address]
        for page in iter_pages(kv_caches, commit.request_id, block_ids, self.max_page_bytes):
            receiver.receive_page(page)
            self.num_pages_sent += 1
        receiver.commit(commit)
