from __future__ import annotations

import asyncio

import grpc

from kvtransfer.base import TransferStatus
from kvtransfer.grpc_transport import GrpcKvSender, KvTransferServicer
from kvtransfer.shm_transport import SharedKvCache, ShmKvSender, host_id
from pdserve.bench.transfer import _ReservingReceiver, format_result, measure_paths, run
from tests.kvtransfer.test_receiver import assert_copied, caches


async def serve(receiver, shared_kv=("", "", "")) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    KvTransferServicer(receiver, shared_kv).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_measured_pushes_deliver_every_page_through_both_transports():
    source, private = caches(fill=1.0), caches()
    k = private[0][0]
    shared = SharedKvCache(len(private), *k.shape, k.dtype)
    block_ids = [1, 2, 5]

    async def main():
        grpc_receiver = _ReservingReceiver(private, block_ids, in_shared_memory=False)
        shm_receiver = _ReservingReceiver(shared.kv_caches, block_ids, in_shared_memory=True)
        grpc_server, grpc_address = await serve(grpc_receiver)
        shm_server, shm_address = await serve(shm_receiver, (shared.name, host_id(), shared.layout))
        grpc_sender, shm_sender = GrpcKvSender(), ShmKvSender(require=True)
        senders = {"shm": (shm_sender, shm_address), "grpc": (grpc_sender, grpc_address)}
        try:
            result = await measure_paths(senders, source, block_ids, 1 << 16, repeats=2, pause_s=0)
        finally:
            await grpc_sender.close()
            await shm_sender.close()
            await grpc_server.stop(0)
            await shm_server.stop(0)
        for receiver, name in ((grpc_receiver, "grpc"), (shm_receiver, "shm")):
            assert {rid: r.status for rid, r in receiver.reservations.items()} == {
                f"{name}-{i}": TransferStatus.DONE
                for i in range(3)  # the warm-up round and 2 measured
            }
        assert grpc_receiver.num_bytes_received == 3 * len(block_ids) * 2 * len(source) * k[0].numel() * 4
        assert shm_receiver.num_bytes_received == 0  # written in place
        assert set(result) == {"memcpy", "shm", "grpc"} and all(rate > 0 for rate in result.values())

    try:
        asyncio.run(main())
        assert_copied(source, private, block_ids, block_ids)
        assert_copied(source, shared.kv_caches, block_ids, block_ids)
    finally:
        shared.unlink()


def test_transfer_benchmark_moves_real_pages_through_both_transports():
    result = run(prompt_tokens=64, repeats=1, pause_s=0.001)
    assert result["bytes"] == 30 * 2 * 4 * 16 * 3 * 64 * 4
    assert result["memcpy"] > 0 and result["hot_memcpy"] > 0 and result["grpc"] > 0 and result["shm"] > 0
    table = format_result(result, 64, 0.001)
    assert "shared memory" in table and "gRPC stream" in table
