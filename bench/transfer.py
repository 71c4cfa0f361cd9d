"""KV transfer bandwidth: gRPC stream on loopback and shared memory, beside a plain memcpy.

One request's pages in the default model's layout (30 layers, 16-token blocks, 3 KV heads of
64, float32) go from a sender in this process to a receiver in another process, through each
transport in turn; effective bandwidth = page bytes / wall time from first byte to the
receiver's commit answer. Each figure is the best of `--repeats` (bandwidth on a shared
machine is noisy downwards only).

    pdserve bench transfer [--prompt-tokens 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import Sequence

import grpc
import torch

from engine.kv_cache import allocate_kv_caches
from kvtransfer.base import KvCommit, KvDestination, KvReceiver
from kvtransfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvTransferServicer
from kvtransfer.shm_transport import SharedKvCache, ShmKvSender, host_id
from protos import kv_transfer_pb2_grpc

LAYOUT = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)


class _ReservingReceiver(KvReceiver):
    """Benchmark receiver: reserves the same blocks for every request id it is sent."""

    def __init__(self, kv_caches, block_ids, in_shared_memory):
        super().__init__(kv_caches, in_shared_memory)
        self.bench_block_ids = block_ids

    def _open_reservation(self, request_id):
        if request_id not in self.reservations:
            self.reserve(request_id, self.bench_block_ids)
        return super()._open_reservation(request_id)


def _serve_receiver(num_blocks: int, ready, info) -> None:
    async def main():
        shared = SharedKvCache(LAYOUT["num_layers"], num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"], torch.float32)
        receiver = _ReservingReceiver(shared.kv_caches, list(range(num_blocks)), in_shared_memory=True)
        server = grpc.aio.server(options=GRPC_OPTIONS)
        kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(KvTransferServicer(receiver), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        info.update(address=f"127.0.0.1:{port}", shm_name=shared.name, layout=shared.layout)
        ready.set()
        try:
            await asyncio.sleep(3600)
        finally:
            shared.unlink()

    torch.set_num_threads(1)
    asyncio.run(main())


def _unlink_if_left(name: str | None) -> None:
    """The receiver process was terminated; its segment may outlive it."""
    from multiprocessing import shared_memory

    if not name:
        return
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    source, target = torch.rand(nbytes // 4), torch.empty(nbytes // 4)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


async def transport_gbps(sender, destination: KvDestination, kv_caches, block_ids, nbytes: int, repeats: int, tag: str) -> float:
    await sender.send(destination, kv_caches, block_ids, KvCommit(f"{tag}-warmup", 1))
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        await sender.send(destination, kv_caches, block_ids, KvCommit(f"{tag}-{i}", 1))
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def run(prompt_tokens: int, repeats: int) -> dict[str, float]:
    num_blocks = -(-prompt_tokens // LAYOUT["block_size"])
    kv_caches = allocate_kv_caches(LAYOUT["num_layers"], num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"], torch.float32, "cpu")
    for k, v in kv_caches:
        k.uniform_()
        v.uniform_()
    nbytes = sum(k.numel() * 4 * 2 for k, _ in kv_caches)
    block_ids = list(range(num_blocks))
    context = multiprocessing.get_context("spawn")
    ready, info = context.Event(), context.Manager().dict()
    child = context.Process(target=_serve_receiver, args=(num_blocks, ready, info), daemon=True)
    child.start()
    try:
        ready.wait(60)
        shm_destination = KvDestination(info["address"], tuple(block_ids), info["shm_name"], host_id(), info["layout"])

        async def both():
            grpc_sender, shm_sender = GrpcKvSender(), ShmKvSender(require=True)
            try:
                grpc_rate = await transport_gbps(grpc_sender, KvDestination(info["address"]), kv_caches, block_ids, nbytes, repeats, "grpc")
                shm_rate = await transport_gbps(shm_sender, shm_destination, kv_caches, block_ids, nbytes, repeats, "shm")
            finally:
                await grpc_sender.close()
                await shm_sender.close()
            return grpc_rate, shm_rate

        grpc_rate, shm_rate = asyncio.run(both())
    finally:
        child.terminate()
        child.join(10)
        _unlink_if_left(info.get("shm_name"))
    return {"bytes": nbytes, "memcpy": memcpy_gbps(nbytes, repeats), "grpc": grpc_rate, "shm": shm_rate}


def format_result(result: dict[str, float], prompt_tokens: int) -> str:
    memcpy = result["memcpy"]
    lines = [
        f"KV transfer of one {prompt_tokens}-token prompt ({result['bytes'] / 1e6:.1f} MB of pages), receiver in another process",
        f"{'path':<22}{'GB/s':>8}{'vs memcpy':>12}",
        f"{'in-process memcpy':<22}{memcpy:>8.2f}{1.0:>11.2f}x",
        f"{'shared memory':<22}{result['shm']:>8.2f}{result['shm'] / memcpy:>11.2f}x",
        f"{'gRPC stream (loopback)':<22}{result['grpc']:>8.2f}{result['grpc'] / memcpy:>11.2f}x",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(format_result(run(args.prompt_tokens, args.repeats), args.prompt_tokens))


if __name__ == "__main__":
    main()
