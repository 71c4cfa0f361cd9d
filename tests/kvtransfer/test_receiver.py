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


def caches(fill: float | None = None):
    kv = allocate_kv_caches(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float32, "cpu")
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
    assert asyncio.run(receiver.wait("r", 1.0)).first_token_id == 42


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
        (dict(dtype="bfloat16"), "dtype"),
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
        asyncio.run(receiver.wait("r", 1.0))


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


def test_wait_times_out_and_fails():
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0])
    with pytest.raises(TransferError, match="did not arrive"):
        asyncio.run(receiver.wait("r", 0.05))
    assert receiver.status("r") == TransferStatus.FAILED
