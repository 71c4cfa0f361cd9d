"""The gRPC stream's staged path (a GPU cache's pages through pinned host buffers), run on CPU
caches through the same code, and on a GPU where there is one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer.base import KEY, VALUE, KvCommit, KvDestination, KvReceiver, TransferStatus, iter_pages
from kvtransfer.grpc_transport import GrpcKvSender
from kvtransfer.host_staging import HostStaging, PinnedBufferPool
from tests.kvtransfer.test_receiver import NUM_LAYERS, assert_copied, caches, push_every_layer
from tests.kvtransfer.test_transports import serve_receiver


def test_a_staged_layer_pages_like_the_cache_read_in_place():
    source = caches(fill=1.0)
    block_ids = [3, 4, 5, 1, 7]  # two runs and a single block
    staged = HostStaging(torch.device("cpu")).stage(source, "r", 1, block_ids)
    in_place = list(iter_pages(source, "r", block_ids, max_bytes=2048, layers=range(1, 2)))
    staged_pages = staged.pages(max_bytes=2048)
    assert [(p.kind, p.block_index, p.num_blocks) for p in staged_pages] == [
        (p.kind, p.block_index, p.num_blocks) for p in in_place
    ]
    assert {p.kind for p in staged_pages} == {KEY, VALUE}
    assert all(bytes(a.data) == bytes(b.data) for a, b in zip(staged_pages, in_place))


def test_the_pool_reuses_buffers_by_size_class_and_keeps_no_more_than_its_cap():
    pool = PinnedBufferPool(pin_memory=False, max_pooled_bytes=4096)
    first, second = pool.take(3000), pool.take(4000)
    assert first.numel() == second.numel() == 4096  # the next power of two
    pool.give(first)
    pool.give(second)  # over the cap: dropped, not kept
    assert pool.take(2500) is first  # same class: reused
    third = pool.take(4096)
    assert third is not first and third is not second


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_staged_pages_cross_the_grpc_stream_into_the_reserved_blocks(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    source = [(k.to(device), v.to(device)) for k, v in caches(fill=1.0)]
    target = caches()

    async def main():
        receiver = KvReceiver(target)
        server, address = await serve_receiver(receiver)
        sender = GrpcKvSender(stage_host_caches=True)
        try:
            receiver.reserve("r", [4, 6, 7])
            await push_every_layer(sender, KvDestination(address), source, [1, 2, 5], KvCommit("r", 9))
            assert receiver.status("r") == TransferStatus.DONE
            staging = sender.staging_for(source)
            assert staging is not None and sum(len(free) for free in staging.pool._free.values()) > 0
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())
    assert_copied([(k.cpu(), v.cpu()) for k, v in source], target, [1, 2, 5], [4, 6, 7])


def test_a_staged_stream_hands_its_buffers_back_and_a_cancelled_one_commits_nothing():
    async def main():
        receiver = KvReceiver(caches())
        server, address = await serve_receiver(receiver)
        sender = GrpcKvSender(stage_host_caches=True)
        source = caches(fill=1.0)
        try:
            receiver.reserve("dropped", [0])
            stream = sender.open_stream(KvDestination(address), source, "dropped")
            for layer in range(NUM_LAYERS):
                stream.send_layer(layer, [3])
            await asyncio.sleep(0.2)  # the stream encodes what it staged and waits for the commit
            stream.cancel()
            await asyncio.sleep(0.05)
            assert len(stream.staged) == NUM_LAYERS and all(staged.released for staged in stream.staged)
            assert receiver.status("dropped") < TransferStatus.DONE
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())
