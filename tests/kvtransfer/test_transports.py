"""The gRPC page stream and the shared-memory transport, end to end in one process, through the
path a prefill node takes: open_stream, send_layer per layer, commit."""

from __future__ import annotations

import asyncio
from multiprocessing import shared_memory

import grpc
import pytest
import torch

from kvtransfer.base import KvCommit, KvDestination, KvReceiver, TransferError, TransferStatus
from kvtransfer.grpc_transport import GrpcKvSender, GrpcKvStream, KvTransferServicer
from kvtransfer.shm_transport import SEGMENT_PREFIX, SharedKvCache, ShmKvSender, host_id, kv_layout
from tests.kvtransfer.test_receiver import assert_copied, caches, push_every_layer


async def serve_receiver(receiver: KvReceiver) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    KvTransferServicer(receiver).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def over_grpc(target, body) -> None:
    """Runs `await body(receiver, sender, destination)` against a receiver over `target` behind a
    real gRPC server, and closes both however it ends."""

    async def main():
        receiver = KvReceiver(target)
        server, address = await serve_receiver(receiver)
        sender = GrpcKvSender()
        try:
            await body(receiver, sender, KvDestination(address))
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())


def test_grpc_stream_delivers_every_page():
    source, target = caches(fill=1.0), caches()

    async def body(receiver, sender, destination):
        receiver.reserve("r", [4, 6])
        await push_every_layer(sender, destination, source, [1, 2], KvCommit("r", 9))
        assert receiver.status("r") == TransferStatus.DONE
        assert (await receiver.wait("r")).first_token_id == 9
        with pytest.raises(TransferError, match="unknown request"):
            await push_every_layer(sender, destination, source, [1], KvCommit("nobody", 9))

    over_grpc(target, body)
    assert_copied(source, target, [1, 2], [4, 6])


def test_grpc_stream_carries_16_bit_caches_bit_for_bit_and_converts_pages_of_another_dtype():
    # --kv-cache-dtype float16 on both nodes: pages travel bit for bit. A prefill node with
    # another cache dtype (under auto: one that quantizes differently) sends its own dtype, and
    # the decode node stores the pages rounded as it rounds the K/V it computes itself.
    source, target = caches(fill=1.0, dtype=torch.float16), caches(dtype=torch.float16)
    float32_source, bfloat16_source = caches(fill=1.0), caches(fill=1.0, dtype=torch.bfloat16)

    async def body(receiver, sender, destination):
        receiver.reserve("r", [4, 6])
        await push_every_layer(sender, destination, source, [1, 2], KvCommit("r", 9))
        receiver.reserve("float32", [0])
        await push_every_layer(sender, destination, float32_source, [1], KvCommit("float32", 9))
        receiver.reserve("bfloat16", [7])
        await push_every_layer(sender, destination, bfloat16_source, [3], KvCommit("bfloat16", 9))
        assert [receiver.status(r) for r in ("r", "float32", "bfloat16")] == [TransferStatus.DONE] * 3

    over_grpc(target, body)
    assert_copied(source, target, [1, 2], [4, 6])
    for converted, source_id, target_id in ((float32_source, 1, 0), (bfloat16_source, 3, 7)):
        for (sk, sv), (tk, tv) in zip(converted, target):
            assert torch.equal(tk[target_id], sk[source_id].to(torch.float16))
            assert torch.equal(tv[target_id], sv[source_id].to(torch.float16))
    float32_keys = float32_source[0][0][1]
    assert not torch.equal(float32_keys, float32_keys.half().float())  # the float32 pages needed rounding


def test_grpc_stream_missing_a_layer_fails_and_a_cancelled_one_commits_nothing():
    async def main():
        receiver = KvReceiver(caches())
        server, address = await serve_receiver(receiver)
        sender = GrpcKvSender()
        try:
            receiver.reserve("short", [0])
            stream = sender.open_stream(KvDestination(address), caches(fill=1.0), "short")
            stream.send_layer(0, [3])
            with pytest.raises(TransferError, match="commit after 2 of 4"):
                await stream.commit(KvCommit("short", 1))
            assert receiver.status("short") == TransferStatus.FAILED

            receiver.reserve("dropped", [1])
            stream = sender.open_stream(KvDestination(address), caches(fill=1.0), "dropped")
            stream.send_layer(0, [3])
            stream.cancel()
            await asyncio.sleep(0.05)
            assert receiver.status("dropped") < TransferStatus.DONE  # the decode node frees it on its own
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())


def test_grpc_stream_to_a_dead_address_fails_its_commit():
    async def main():
        server, address = await serve_receiver(KvReceiver(caches()))
        await server.stop(0)
        sender = GrpcKvSender()
        try:
            with pytest.raises(TransferError, match=f"push to {address} failed"):
                await push_every_layer(sender, KvDestination(address), caches(fill=1.0), [0], KvCommit("r", 1))
        finally:
            await sender.close()

    asyncio.run(main())


def test_grpc_lease_renewal_extends_open_reservations_and_names_the_released_ones():
    async def main():
        receiver = KvReceiver(caches(), lease_s=1.5)
        server, address = await serve_receiver(receiver)
        sender = GrpcKvSender()
        try:
            receiver.reserve("kept", [0])
            receiver.reserve("dropped", [1])
            receiver.forget("dropped")
            renewal = await sender.renew_leases(address, ["kept", "dropped"], timeout_s=5)
            assert renewal.released_request_ids == ["dropped"] and renewal.lease_s == 1.5
            await server.stop(0)
            with pytest.raises(TransferError, match=f"renewal at {address} failed: UNAVAILABLE"):
                await sender.renew_leases(address, ["kept"], timeout_s=5)
        finally:
            await sender.close()

    asyncio.run(main())


@pytest.fixture
def shared_cache():
    k = caches()[0][0]
    shared = SharedKvCache(len(caches()), *k.shape, k.dtype)
    yield shared
    shared.unlink()


def test_shared_memory_writes_pages_in_place_and_commits_over_grpc(shared_cache):
    source = caches(fill=1.0)

    async def main():
        receiver = KvReceiver(shared_cache.kv_caches, in_shared_memory=True)
        server, address = await serve_receiver(receiver)
        sender = ShmKvSender(require=True)
        try:
            receiver.reserve("r", [7, 3, 5])
            destination = KvDestination(address, (7, 3, 5), shared_cache.name, host_id(), shared_cache.layout)
            assert shared_cache.layout == kv_layout(source)
            await push_every_layer(sender, destination, source, [0, 1, 2], KvCommit("r", 11))
            assert (await receiver.wait("r")).first_token_id == 11
            assert receiver.num_bytes_received == 0  # no page crossed gRPC
            assert (await sender.renew_leases(address, ["r"], timeout_s=5)).released_request_ids == []  # over gRPC
            with pytest.raises(TransferError, match="no shared-memory"):
                sender.open_stream(KvDestination(address), source, "x")
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())
    assert_copied(source, shared_cache.kv_caches, [0, 1, 2], [7, 3, 5])


def test_shared_memory_refuses_blocks_that_do_not_match_the_reservation(shared_cache):
    async def main():
        receiver = KvReceiver(shared_cache.kv_caches, in_shared_memory=True)
        server, address = await serve_receiver(receiver)
        sender = ShmKvSender(require=True)
        try:
            receiver.reserve("r", [7, 3])
            destination = KvDestination(address, (7, 3), shared_cache.name, host_id(), shared_cache.layout)
            stream = sender.open_stream(destination, caches(fill=1.0), "r")
            with pytest.raises(TransferError, match="3 blocks to send, 2 reserved"):
                stream.send_layer(0, [0, 1, 2])
            with pytest.raises(TransferError, match="3 blocks to send, 2 reserved"):
                await stream.commit(KvCommit("r", 1))
            assert receiver.status("r") == TransferStatus.PENDING  # the commit never reached it
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())


def test_shared_memory_sender_falls_back_to_the_grpc_stream_on_another_host(shared_cache):
    source, target = caches(fill=1.0), caches()

    async def main():
        receiver = KvReceiver(target)
        server, address = await serve_receiver(receiver)
        sender = ShmKvSender()
        try:
            receiver.reserve("r", [2, 0])
            elsewhere = KvDestination(address, (2, 0), shared_cache.name, "another-host", shared_cache.layout)
            assert isinstance(sender.open_stream(elsewhere, source, "probe"), GrpcKvStream)
            await push_every_layer(sender, elsewhere, source, [5, 6], KvCommit("r", 3))
            assert receiver.status("r") == TransferStatus.DONE
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())
    assert_copied(source, target, [5, 6], [2, 0])


def test_shared_memory_commit_is_refused_by_a_private_cache():
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0])
    with pytest.raises(TransferError, match="commit after 0"):
        receiver.commit(KvCommit("r", 1, pages_in_shared_memory=True))


def test_shared_memory_sender_attaches_to_no_segment_without_the_pdserve_prefix(shared_cache):
    assert shared_cache.name.startswith(SEGMENT_PREFIX)
    sender = ShmKvSender(require=True)
    other = shared_memory.SharedMemory(create=True, size=4096)  # some other program's segment
    try:
        unrelated = KvDestination("127.0.0.1:1", (0,), other.name, host_id(), shared_cache.layout)
        with pytest.raises(TransferError, match="no shared-memory"):
            sender.open_stream(unrelated, caches(fill=1.0), "t")
        assert bytes(other.buf[:16]) == bytes(16)
    finally:
        other.close()
        other.unlink()
