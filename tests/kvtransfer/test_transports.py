"""The gRPC page stream and the shared-memory transport, end to end in one process."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvtransfer.base import KvCommit, KvDestination, KvReceiver, TransferError, TransferStatus
from kvtransfer.grpc_transport import GrpcKvSender, KvTransferServicer
from kvtransfer.shm_transport import SharedKvCache, ShmKvSender, host_id, kv_layout
from tests.kvtransfer.test_receiver import caches


async def serve_receiver(receiver: KvReceiver) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    KvTransferServicer(receiver).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def assert_copied(source, target, source_ids, target_ids):
    for (sk, sv), (tk, tv) in zip(source, target):
        assert torch.equal(tk[target_ids], sk[source_ids]) and torch.equal(tv[target_ids], sv[source_ids])


def test_grpc_stream_delivers_every_page():
    source, target = caches(fill=1.0), caches()

    async def main():
        receiver = KvReceiver(target)
        server, address = await serve_receiver(receiver)
        sender = GrpcKvSender()
        try:
            receiver.reserve("r", [4, 6])
            await sender.send(KvDestination(address), source, [1, 2], KvCommit("r", 9))
            assert receiver.status("r") == TransferStatus.DONE
            with pytest.raises(TransferError, match="unknown request"):
                await sender.send(KvDestination(address), source, [1], KvCommit("nobody", 9))
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())
    assert_copied(source, target, [1, 2], [4, 6])


def test_shared_memory_writes_pages_in_place_and_commits_over_grpc():
    source = caches(fill=1.0)
    k = source[0][0]
    shared = SharedKvCache(len(source), *k.shape, k.dtype)

    async def main():
        receiver = KvReceiver(shared.kv_caches, in_shared_memory=True)
        server, address = await serve_receiver(receiver)
        sender = ShmKvSender(require=True)
        try:
            receiver.reserve("r", [7, 3, 5])
            destination = KvDestination(address, (7, 3, 5), shared.name, host_id(), shared.layout)
            assert shared.layout == kv_layout(source)
            await sender.send(destination, source, [0, 1, 2], KvCommit("r", 11))
            assert (await receiver.wait("r", 1.0)).first_token_id == 11
            with pytest.raises(TransferError, match="no shared-memory"):
                await sender.send(KvDestination(address), source, [0], KvCommit("x", 1))
        finally:
            await sender.close()
            await server.stop(0)

    try:
        asyncio.run(main())
        assert_copied(source, shared.kv_caches, [0, 1, 2], [7, 3, 5])
    finally:
        shared.unlink()


def test_shared_memory_commit_is_refused_by_a_private_cache():
    receiver = KvReceiver(caches())
    receiver.reserve("r", [0])
    with pytest.raises(TransferError, match="commit after 0"):
        receiver.commit(KvCommit("r", 1, pages_in_shared_memory=True))
