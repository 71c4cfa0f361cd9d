"""`make gpu-check`'s cross-host KV transfer figure (pdserve/gpu_check.py runs it): the gRPC
path a GPU prefill node takes to a decode node on another host, here on loopback."""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from kvtransfer.base import KvCommit, KvDestination, KvReceiver
from kvtransfer.grpc_transport import GrpcKvSender, KvTransferServicer


def grpc_bandwidth(num_layers: int, num_blocks: int) -> dict:
    """A GPU cache's pages pushed as a prefill node pushes them to a decode node on another host
    (staged in pinned host memory, then the gRPC stream), here to a receiver in this process on
    127.0.0.1 whose cache is on the GPU too. On CPU (smoke) the caches stay on the host."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (num_blocks, 16, 8, 128)
    source = [tuple(torch.randn(shape, device=device).bfloat16() for _ in "kv") for _ in range(num_layers)]
    target = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in source]
    blocks = list(range(num_blocks))
    num_bytes = sum(2 * k.numel() * k.element_size() for k, _ in source)

    async def pushes(repeats: int) -> float:
        receiver, server = KvReceiver(target), grpc.aio.server()
        KvTransferServicer(receiver).add_to_server(server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        sender = GrpcKvSender(stage_host_caches=True)
        try:
            times = []
            for i in range(repeats):
                receiver.reserve(f"r{i}", blocks)
                start = time.perf_counter()
                stream = sender.open_stream(KvDestination(address), source, f"r{i}")
                for layer in range(num_layers):
                    stream.send_layer(layer, blocks)
                await stream.commit(KvCommit(f"r{i}", 0))
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return sorted(times[1:])[len(times[1:]) // 2]  # the first warms channel and buffers
        finally:
            await sender.close()
            await server.stop(0)

    seconds = asyncio.run(pushes(4))
    landed = all(torch.equal(k, tk) and torch.equal(v, tv) for (k, v), (tk, tv) in zip(source, target))
    return {"gib": round(num_bytes / 2**30, 2), "gb_per_s": round(num_bytes / seconds / 1e9, 2), "ok": landed}
