"""KV transfer bandwidth: gRPC stream on loopback and shared memory, beside a plain memcpy.

One request's pages in the default model's layout (30 layers, 16-token blocks, 3 KV heads of
64, float32) go from a sender in this process to a receiver in another process, through each
transport in turn and the way a prefill node sends them (open a stream, send every layer from
a worker thread, commit); effective bandwidth = page bytes / wall time from opening the stream
to the receiver's commit answer. Each figure is the best of `--repeats` (bandwidth on a shared
machine is noisy downwards only). The paths take turns, each after the same pause, and the
memcpy they are compared with is timed the same way: copies run back to back stay in the
last-level cache (260 MiB on the reference machine) and run about twice as fast as any
single transfer can, which is printed too.

    pdserve bench transfer [--prompt-tokens 1000] [--repeats 10] [--pause-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import Sequence

import grpc
import torch

from kvtransfer.base import KvCommit, KvDestination, KvReceiver, KvSender
from kvtransfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvTransferServicer
from kvtransfer.shm_transport import SharedKvCache, ShmKvSender, host_id
from pdserve.engine.kv_cache import allocate_kv_caches

RESERVATION_TIMEOUT_S = 10.0
LAYOUT = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)


class _ReservingReceiver(KvReceiver):
    """Benchmark receiver: the first GetReservation of a token reserves the same blocks for it
    (a decode node reserves at Generate; here the sender's own call stands in for that)."""

    def __init__(self, kv_caches, block_ids, in_shared_memory):
        super().__init__(kv_caches, in_shared_memory)
        self.bench_block_ids = block_ids

    def reservation(self, token):
        if token not in self.reservations:
            self.reserve(token, self.bench_block_ids)
        return super().reservation(token)


def _serve_receiver(num_blocks: int, ready, info) -> None:
    async def main():
        shared = SharedKvCache(
            LAYOUT["num_layers"],
            num_blocks,
            LAYOUT["block_size"],
            LAYOUT["num_kv_heads"],
            LAYOUT["head_dim"],
            torch.float32,
        )
        receiver = _ReservingReceiver(shared.kv_caches, list(range(num_blocks)), in_shared_memory=True)
        server = grpc.aio.server(options=GRPC_OPTIONS)
        KvTransferServicer(receiver, (shared.name, host_id(), shared.layout)).add_to_server(server)
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


def hot_memcpy_gbps(nbytes: int, repeats: int) -> float:
    """Back-to-back copies: source and target (2x the pages) stay in this CPU's last-level
    cache, so this is a cache figure, not what a single transfer sees."""
    source, target = torch.rand(nbytes // 4), torch.empty(nbytes // 4)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


async def push_every_layer(sender: KvSender, destination: KvDestination, kv_caches, block_ids, commit: KvCommit):
    """One request's push as a prefill node does it: the stream opens on the event loop, every
    layer is sent from another thread (the engine's, there), and the commit follows. (The
    prefill node asks for the reservation before its forward pass: not part of the transfer.)"""
    stream = sender.open_stream(destination, kv_caches, commit.request_id)

    def send_every_layer() -> None:
        for layer in range(len(kv_caches)):
            stream.send_layer(layer, block_ids)

    await asyncio.to_thread(send_every_layer)
    await stream.commit(commit)


async def measure_paths(
    senders: dict, kv_caches, block_ids, nbytes: int, repeats: int, pause_s: float
) -> dict[str, float]:
    """Best bandwidth of each path; every measured transfer (the memcpy included) follows the
    same pause, so all of them start from the same cache state, as one request's push does."""
    source, target = torch.rand(nbytes // 4), torch.empty(nbytes // 4)

    async def memcpy(tag: str, destination: None) -> None:
        target.copy_(source)

    def push(sender: KvSender, address: str):
        async def transfer(tag: str, destination: KvDestination) -> None:
            await push_every_layer(sender, destination, kv_caches, block_ids, KvCommit(tag, 1))

        return lambda tag: sender.get_reservation(address, tag, RESERVATION_TIMEOUT_S), transfer

    async def no_reservation(tag: str) -> None:
        return None

    paths = {"memcpy": (no_reservation, memcpy), **{name: push(*sender) for name, sender in senders.items()}}
    best = dict.fromkeys(paths, float("inf"))
    for round_index in range(repeats + 1):  # round 0 warms every path up
        for name, (reserve, transfer) in paths.items():
            tag = f"{name}-{round_index}"
            destination = await reserve(tag)
            await asyncio.sleep(pause_s)
            start = time.perf_counter()
            await transfer(tag, destination)
            if round_index:
                best[name] = min(best[name], time.perf_counter() - start)
    return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}


def run(prompt_tokens: int, repeats: int, pause_s: float) -> dict[str, float]:
    num_blocks = -(-prompt_tokens // LAYOUT["block_size"])
    kv_caches = allocate_kv_caches(
        LAYOUT["num_layers"],
        num_blocks,
        LAYOUT["block_size"],
        LAYOUT["num_kv_heads"],
        LAYOUT["head_dim"],
        torch.float32,
        "cpu",
    )
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

        async def measure():
            grpc_sender, shm_sender = GrpcKvSender(), ShmKvSender(require=True)
            senders = {"shm": (shm_sender, info["address"]), "grpc": (grpc_sender, info["address"])}
            try:
                return await measure_paths(senders, kv_caches, block_ids, nbytes, repeats, pause_s)
            finally:
                await grpc_sender.close()
                await shm_sender.close()

        result = asyncio.run(measure())
    finally:
        child.terminate()
        child.join(10)
        _unlink_if_left(info.get("shm_name"))
    return {"bytes": nbytes, "hot_memcpy": hot_memcpy_gbps(nbytes, repeats), **result}


def format_result(result: dict[str, float], prompt_tokens: int, pause_s: float) -> str:
    memcpy = result["memcpy"]
    rows = [
        ("in-process memcpy", memcpy),
        ("shared memory", result["shm"]),
        ("gRPC stream (loopback)", result["grpc"]),
        ("memcpy, back to back", result["hot_memcpy"]),
    ]
    lines = [
        f"KV transfer of one {prompt_tokens}-token prompt ({result['bytes'] / 1e6:.1f} MB of pages), "
        "receiver in another process",
        f"each path timed after the same {pause_s * 1e3:.0f} ms pause; "
        "the last line is the cache-hot copy rate, for reference",
        f"{'path':<24}{'GB/s':>8}{'vs memcpy':>12}",
    ]
    lines += [f"{name:<24}{rate:>8.2f}{rate / memcpy:>11.2f}x" for name, rate in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pause-ms", type=float, default=20.0, help="idle time before each measured transfer")
    args = parser.parse_args(argv)
    print(
        format_result(
            run(args.prompt_tokens, args.repeats, args.pause_ms / 1e3), args.prompt_tokens, args.pause_ms / 1e3
        )
    )


if __name__ == "__main__":
    main()
