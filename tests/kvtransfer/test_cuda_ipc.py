"""The CUDA IPC transport's plumbing, without a GPU: what a reservation carries, when the sender
goes device to device and when it hands over, and the in-place copy and commit (run here on
CPU tensors standing in for the opened cache). Opening a real handle across processes, and its
bandwidth, are in make gpu-check."""

from __future__ import annotations

import asyncio
import json

import pytest

from decode_service.server import DecodeNodeService
from kvtransfer.base import KvCommit, KvDestination, KvReceiver, TransferError
from kvtransfer.cuda_ipc import open_kv_caches
from kvtransfer.cuda_ipc_transport import CudaIpcKvSender, CudaIpcKvStream
from kvtransfer.grpc_transport import GrpcKvSender, GrpcKvStream
from kvtransfer.shm_transport import ShmKvSender, host_id, kv_layout
from prefill_service.server import kv_sender
from tests.kvtransfer.test_receiver import assert_copied, caches, push_every_layer
from tests.kvtransfer.test_transports import serve_receiver

HANDLE = json.dumps({"uuid": "GPU-not-here", "shape": []}).encode()


def test_a_reservation_carries_the_exported_handle():
    async def main():
        receiver = KvReceiver(caches(), in_shared_memory=True)
        server, address = await serve_receiver_with_handle(receiver, HANDLE)
        sender = GrpcKvSender()
        try:
            receiver.reserve("t", [4, 1])
            destination = await sender.get_reservation(address, "t", timeout_s=5)
            assert destination.cuda_ipc_handle == HANDLE
            assert (destination.host_id, destination.kv_layout) == (host_id(), kv_layout(caches()))
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())


async def serve_receiver_with_handle(receiver, handle):
    import grpc

    from kvtransfer.grpc_transport import KvTransferServicer

    server = grpc.aio.server()
    KvTransferServicer(receiver, ("", host_id(), kv_layout(receiver.kv_caches)), handle).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_pages_copied_in_place_commit_over_grpc_as_written_in_place():
    source, target = caches(fill=1.0), caches()

    async def main():
        receiver = KvReceiver(target, in_shared_memory=True)
        server, address = await serve_receiver(receiver)
        sender = CudaIpcKvSender(GrpcKvSender(), require=True)
        try:
            receiver.reserve("r", [7, 3, 5])
            destination = KvDestination(address, (7, 3, 5), "", host_id(), kv_layout(source), cuda_ipc_handle=HANDLE)
            stream = CudaIpcKvStream(sender, destination, source, target)  # target: the "opened" cache
            await push_every_layer(FixedStream(stream), destination, source, [0, 1, 2], KvCommit("r", 11))
            assert (await receiver.wait("r")).first_token_id == 11
            assert receiver.num_bytes_received == 0  # no page crossed gRPC
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(main())
    assert_copied(source, target, [0, 1, 2], [7, 3, 5])


class FixedStream:
    """A sender whose open_stream returns the stream given (push_every_layer takes a sender)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def open_stream(self, destination, kv_caches, request_id):
        return self.stream


def test_the_sender_hands_over_whatever_cannot_go_device_to_device():
    source = caches(fill=1.0)
    inner = ShmKvSender(GrpcKvSender())
    sender = CudaIpcKvSender(inner)
    layout = kv_layout(source)
    cases = [
        KvDestination("127.0.0.1:1", (0,), "", host_id(), layout),  # no handle: a CPU decode node
        KvDestination("127.0.0.1:1", (0,), "", host_id(), layout, cuda_ipc_handle=HANDLE),  # a CPU cache here
        KvDestination("127.0.0.1:1", (0,), "", "another-host", layout, cuda_ipc_handle=HANDLE),
    ]

    async def main():  # a gRPC stream belongs to the event loop it was opened on
        for destination in cases:
            assert isinstance(sender.open_stream(destination, source, "r"), GrpcKvStream)
        strict = CudaIpcKvSender(GrpcKvSender(), require=True)
        with pytest.raises(TransferError, match="no CUDA IPC KV cache"):
            strict.open_stream(cases[1], source, "r")
        await sender.close()

    asyncio.run(main())


def test_a_handle_to_a_gpu_this_process_cannot_see_opens_nothing():
    assert open_kv_caches(HANDLE, kv_layout(caches())) is None


def test_each_transport_flag_builds_its_sender_and_decode_nodes_export_only_gpu_caches():
    grpc_sender = GrpcKvSender()
    assert kv_sender("grpc", grpc_sender) is grpc_sender
    assert isinstance(kv_sender("shm", grpc_sender), ShmKvSender)
    assert kv_sender("cuda_ipc", grpc_sender).require
    auto = kv_sender("auto", grpc_sender)
    assert isinstance(auto, CudaIpcKvSender) and isinstance(auto.inner, ShmKvSender) and not auto.require
    assert DecodeNodeService("auto", 10.0, 5.0, device="cuda").exports_cuda_ipc
    assert not DecodeNodeService("auto", 10.0, 5.0).exports_cuda_ipc
    assert not DecodeNodeService("grpc", 10.0, 5.0, device="cuda").exports_cuda_ipc
    assert not DecodeNodeService("auto", 10.0, 5.0, colocated=True, device="cuda").exports_cuda_ipc
    with pytest.raises(ValueError, match="--device cuda"):
        DecodeNodeService("cuda_ipc", 10.0, 5.0)
