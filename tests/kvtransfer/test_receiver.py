"""The receiver checks every page against the reservation and fails only that transfer."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer.base import (
    KEY,
    VALUE,
    KvCommit,
    KvDestination,
    KvPage,
    KvReceiver,
    KvSender,
    TransferError,
    TransferStatus,
    iter_pages,
)
from kvtransfer.fake import FakeKvSender
from pdserve.engine.kv_cache import allocate_kv_caches

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 8, 4, 2, 8


def caches(fill: float | None = None, dtype: torch.dtype = torch.float32):
    kv = allocate_kv_caches(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype, "cpu")
    if fill is not None:
        for k, v in kv:
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
    return kv


def page(request_id="r", layer=0, kind=KEY, block_index=0, num_blocks=1, dtype="float32", nbytes=None):
    nbytes = num_blocks * BLOCK_SIZE * HEADS * DIM * 4 if nbytes is None else nbytes
    return KvPage(request_id, layer, kind, block_index, num_blocks, dtype, bytes(nbytes))


async def push_every_layer(sender: KvSender, destination: KvDestination, source, block_ids, commit: KvCommit) -> None:
    """What a prefill node does: open the stream, send each layer's pages, commit; a layer is
    sent from a worker thread, as the engine thread sends it between two layers."""
    stream = sender.open_stream(destination, source, commit.request_id)
    for layer in range(len(source)):
        await asyncio.to_thread(stream.send_layer, layer, block_ids)
    await stream.commit(commit)


def assert_copied(source, target, source_ids, target_ids):
    for (sk, sv), (tk, tv) in zip(source, target):
        assert torch.equal(tk[target_ids], sk[source_ids]) and torch.equal(tv[target_ids], sv[source_ids])


def test_pages_land_in_the_reserved_blocks_and_commit_completes():
    source, target = caches(fill=1.0), caches()
    receiver = KvReceiver(target)
    receiver.reserve("r", [5, 2, 7])
    sender = FakeKvSender({"decode": receiver}, max_page_bytes=300)  # 256-byte blocks: one per page
    asyncio.run(push_every_layer(sender, KvDestination("decode"), source, [0, 1, 3], KvCommit("r", 42)))
    assert receiver.status("r") == TransferStatus.DONE
    assert sender.num_pages_sent == NUM_LAYERS * 2 * 3
    assert_copied(source, target, [0, 1, 3], [5, 2, 7])
    assert asyncio.run(receiver.wait("r")).first_token_id == 42


def test_a_stream_missing_a_layer_fails_its_commit():
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0, 1])

    async def main():
        stream = FakeKvSender({"decode": receiver}).open_stream(KvDestination("decode"), caches(fill=1.0), "r")
        stream.send_layer(0, [0, 1])
        with pytest.raises(TransferError, match="commit after 4 of 8"):
            await stream.commit(KvCommit("r", 1))

    asyncio.run(main())
    assert receiver.status("r") == TransferStatus.FAILED


def test_pages_respect_the_message_size_limit():
    block_bytes = BLOCK_SIZE * HEADS * DIM * 4
    pages = list(iter_pages(caches(), "r", list(range(8)), max_bytes=3 * block_bytes + 1024))
    assert all(len(p.data) <= 3 * block_bytes for p in pages)
    assert sum(p.num_blocks for p in pages) == NUM_LAYERS * 2 * 8
    assert {len(p.data) // block_bytes for p in pages} == {3, 2}


def test_unknown_request_is_rejected():
    receiver = KvReceiver(caches())
    with pytest.raises(TransferError, match="unknown request"):
        receiver.receive_page(page("nobody"))


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(nbytes=10), "bytes"),
        (dict(dtype="int8"), "dtype 'int8', expected one of float32, float16, bfloat16"),
        (dict(dtype="bfloat16"), "bytes, expected 128 \\(bfloat16\\)"),  # a float32 page's length
        (dict(layer=NUM_LAYERS), "layer"),
        (dict(block_index=2, num_blocks=2), "outside"),
    ],
)
def test_a_page_that_does_not_fit_fails_that_transfer_only(bad, reason):
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0, 1, 2])
    receiver.reserve("other", [3])
    with pytest.raises(TransferError, match=reason):
        receiver.receive_page(page(**bad))
    assert receiver.status("r") == TransferStatus.FAILED
    assert receiver.status("other") == TransferStatus.PENDING
    with pytest.raises(TransferError, match=reason):
        asyncio.run(receiver.wait("r"))


def test_duplicate_page_fails_the_transfer():
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0, 1])
    receiver.receive_page(page(kind=VALUE))
    with pytest.raises(TransferError, match="duplicate"):
        receiver.receive_page(page(kind=VALUE))
    assert receiver.status("r") == TransferStatus.FAILED


def test_commit_before_every_page_fails():
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0])
    receiver.receive_page(page())
    with pytest.raises(TransferError, match="commit after 1 of 4"):
        receiver.commit(KvCommit("r", 1))


def test_a_lease_nobody_renews_expires_and_fails_the_wait():
    receiver = KvReceiver(caches(), lease_s=0.05)
    receiver.reserve("r", [0])
    with pytest.raises(TransferError, match=r"lease expired \(0.1 s without a renewal\)"):
        asyncio.run(receiver.wait("r"))
    assert receiver.status("r") == TransferStatus.FAILED


def test_renewals_keep_a_reservation_for_many_lease_periods_until_its_pages_arrive():
    receiver = KvReceiver(caches(), lease_s=0.2)
    receiver.reserve("r", [0])

    async def prefill_node_with_a_long_queue():
        for _ in range(20):  # 0.6 s: three lease periods
            await asyncio.sleep(0.03)
            assert receiver.renew(["r"]).released_request_ids == []
        for kind in (KEY, VALUE):
            for layer in range(NUM_LAYERS):
                receiver.receive_page(page(layer=layer, kind=kind))
        receiver.commit(KvCommit("r", 5))

    async def main():
        renewing = asyncio.create_task(prefill_node_with_a_long_queue())
        commit = await receiver.wait("r")
        await renewing
        return commit

    assert asyncio.run(main()).first_token_id == 5


def test_pages_arriving_keep_the_lease_too():
    receiver = KvReceiver(caches(), lease_s=0.2)
    receiver.reserve("r", [0, 1])

    async def slow_push():
        for layer, kind in [(layer, kind) for layer in range(NUM_LAYERS) for kind in (KEY, VALUE)]:
            await asyncio.sleep(0.08)  # 0.32 s in all, each gap well within the lease
            receiver.receive_page(page(layer=layer, kind=kind, num_blocks=2))
        receiver.commit(KvCommit("r", 6))

    async def main():
        pushing = asyncio.create_task(slow_push())
        commit = await receiver.wait("r")
        await pushing
        return commit

    assert asyncio.run(main()).first_token_id == 6


def test_a_renewal_names_the_requests_the_receiver_no_longer_holds():
    receiver = KvReceiver(caches(), lease_s=2.5)
    for rid in ("open", "failed", "forgotten", "done"):
        receiver.reserve(rid, [0])
    receiver.fail("failed", "bad page")
    receiver.forget("forgotten")
    for layer in range(NUM_LAYERS):
        for kind in (KEY, VALUE):
            receiver.receive_page(page("done", layer=layer, kind=kind))
    receiver.commit(KvCommit("done", 1))
    renewal = receiver.renew(["open", "failed", "forgotten", "done", "never-reserved"])
    assert renewal.released_request_ids == ["failed", "forgotten", "never-reserved"]
    assert renewal.lease_s == 2.5


def test_a_shared_memory_commit_without_pages_is_refused_and_stale_kv_never_admitted():
    shared = caches(fill=7.0)  # an earlier request's KV left in the blocks
    receiver = KvReceiver(shared, in_shared_memory=True)
    receiver.reserve("t", [1, 2])
    assert all(bool(cache[[1, 2], 0].eq(0).all()) for layer in shared for cache in layer)  # first slots zeroed
    with pytest.raises(TransferError, match="commit after 0"):
        receiver.commit(KvCommit("t", 1, pages_in_shared_memory=True))
    assert receiver.status("t") == TransferStatus.FAILED


def test_a_shared_memory_commit_after_a_partial_write_is_refused():
    shared = caches()
    receiver = KvReceiver(shared, in_shared_memory=True)
    receiver.reserve("t", [1, 2])
    for layer in shared:
        for cache in layer:
            cache[1].fill_(3.0)  # block 2 never written
    with pytest.raises(TransferError):
        receiver.commit(KvCommit("t", 1, pages_in_shared_memory=True))
    receiver.reserve("u", [1, 2])
    for layer in shared:
        for cache in layer:
            cache[[1, 2]] = 3.0
    receiver.commit(KvCommit("u", 1, pages_in_shared_memory=True))
    assert receiver.status("u") == TransferStatus.DONE
