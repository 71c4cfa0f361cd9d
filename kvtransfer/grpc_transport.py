"""KV transfer over a gRPC client stream: raw page bytes, at most 4 MiB per message.

The prefill node opens one `PushKv` stream per request to the decode node's
KvTransferService, sends every page, then a commit; the decode node's servicer feeds each
message to its KvReceiver and answers once, with ok or the first error.
"""

from __future__ import annotations

import asyncio

import grpc

from kvtransfer.base import KvCommit, KvDestination, KvPage, KvReceiver, KvSender, KvStream, TransferError, iter_pages
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.convert import logprob_from_proto, logprob_to_proto

NUM_PARALLEL_STREAMS = 2
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    # Page streams are bulk data: larger HTTP/2 frames and flow-control windows cut per-frame work.
    ("grpc.http2.max_frame_size", 16 << 20 - 1),
    ("grpc.http2.bdp_probe", 1),
    ("grpc.http2.lookahead_bytes", 64 << 20),
]


def page_to_proto(page: KvPage) -> kv_transfer_pb2.PushKvRequest:
    return kv_transfer_pb2.PushKvRequest(
        page=kv_transfer_pb2.KvPage(
            request_id=page.request_id,
            layer=page.layer,
            kind=page.kind,
            block_index=page.block_index,
            num_blocks=page.num_blocks,
            dtype=page.dtype,
            data=page.data,
        )
    )


def page_from_proto(message: kv_transfer_pb2.KvPage) -> KvPage:
    return KvPage(
        message.request_id, message.layer, int(message.kind), message.block_index, message.num_blocks, message.dtype, message.data
    )


def commit_to_proto(commit: KvCommit) -> kv_transfer_pb2.PushKvRequest:
    message = kv_transfer_pb2.KvCommit(
        request_id=commit.request_id, first_token_id=commit.first_token_id, pages_in_shared_memory=commit.pages_in_shared_memory
    )
    if commit.first_logprob is not None:
        message.first_logprob.CopyFrom(logprob_to_proto(commit.first_logprob))
    return kv_transfer_pb2.PushKvRequest(commit=message)


def commit_from_proto(c: kv_transfer_pb2.KvCommit) -> KvCommit:
    logprob = logprob_from_proto(c.first_logprob) if c.HasField("first_logprob") else None
    return KvCommit(c.request_id, c.first_token_id, logprob, c.pages_in_shared_memory)


class GrpcKvSender(KvSender):
    """Keeps one channel per decode address."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def send(self, destination: KvDestination, kv_caches, block_ids: list[int], commit: KvCommit) -> None:
        # Two streams (even and odd layers) keep sender, wire and receiver busy at once; the
        # commit follows when both are in.
        layer_sets = [range(start, len(kv_caches), NUM_PARALLEL_STREAMS) for start in range(NUM_PARALLEL_STREAMS)]
        await asyncio.gather(
            *(self._push(destination.address, self._pages(kv_caches, block_ids, commit.request_id, layers)) for layers in layer_sets)
        )
        await self.commit(destination, commit)

    def open_stream(self, destination: KvDestination, kv_caches, request_id: str) -> GrpcKvStream:
        return GrpcKvStream(self, destination, kv_caches, request_id)

    async def commit(self, destination: KvDestination, commit: KvCommit) -> None:
        """The commit alone, in one unary call (the pages travelled another way)."""
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(self._channel(destination.address))
        try:
            response = await stub.CommitKv(commit_to_proto(commit).commit)
        except grpc.aio.AioRpcError as error:
            raise TransferError(f"commit to {destination.address} failed: {error.code().name} {error.details()}") from error
        if not response.ok:
            raise TransferError(response.error)

    async def _push(self, address: str, messages) -> None:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(self._channel(address))
        try:
            response = await stub.PushKv(messages)
        except grpc.aio.AioRpcError as error:
            raise TransferError(f"push to {address} failed: {error.code().name} {error.details()}") from error
        if not response.ok:
            raise TransferError(response.error)

    @staticmethod
    async def _pages(kv_caches, block_ids, request_id: str, layers: range):
        for page in iter_pages(kv_caches, request_id, block_ids, layers=layers):
            yield page_to_proto(page)


    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class GrpcKvStream(KvStream):
    """The PushKv call starts at once; pages join its queue as the engine finishes each layer,
    so their transfer overlaps the rest of the forward pass."""

    def __init__(self, sender: GrpcKvSender, destination: KvDestination, kv_caches, request_id: str) -> None:
        self.kv_caches = kv_caches
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.call = asyncio.create_task(sender._push(destination.address, self._messages()))

    def send_layer(self, layer: int, block_ids: list[int]) -> None:
        pages = [page_to_proto(p) for p in iter_pages(self.kv_caches, self.request_id, block_ids, layers=range(layer, layer + 1))]
        self.loop.call_soon_threadsafe(self.queue.put_nowait, pages)

    async def commit(self, commit: KvCommit) -> None:
        self.queue.put_nowait([commit_to_proto(commit)])
        await self.call

    def cancel(self) -> None:
        self.call.cancel()

    async def _messages(self):
        while True:
            for message in await self.queue.get():
                yield message
                if message.HasField("commit"):
                    return


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServiceServicer):
    """Decode side: feeds every pushed message to the receiver; the first error ends the stream."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    async def PushKv(self, request_iterator, context) -> kv_transfer_pb2.PushKvResponse:
        try:
            async for message in request_iterator:
                if message.HasField("page"):
                    self.receiver.receive_page(page_from_proto(message.page))
                else:
                    self.receiver.commit(commit_from_proto(message.commit))
        except TransferError as error:
            return kv_transfer_pb2.PushKvResponse(ok=False, error=str(error))
        return kv_transfer_pb2.PushKvResponse(ok=True)

    async def CommitKv(self, request: kv_transfer_pb2.KvCommit, context) -> kv_transfer_pb2.PushKvResponse:
        try:
            self.receiver.commit(commit_from_proto(request))
        except TransferError as error:
            return kv_transfer_pb2.PushKvResponse(ok=False, error=str(error))
        return kv_transfer_pb2.PushKvResponse(ok=True)
