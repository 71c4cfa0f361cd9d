"""KV transfer over a gRPC client stream: raw page bytes, at most 4 MiB per message.

The prefill node opens one `PushKv` stream per request to the decode node's KvTransferService,
sends each layer's pages as it is computed, then a commit; the decode node's servicer feeds each
message to its KvReceiver and answers once, with ok or the first error. Page messages are encoded and decoded by
`page_codec` (one copy of the bytes per side), not by the generated stubs. `RenewLeases` renews
the receiver's reservations for prompts still waiting on the prefill node (kvtransfer/lease.py).
A GPU cache's pages go through pinned host buffers, copied while later layers compute
(host_staging.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence

import grpc
import torch

from kvtransfer.base import (
    MAX_MESSAGE_BYTES,
    KvCommit,
    KvDestination,
    KvReceiver,
    KvSender,
    KvStream,
    LeaseRenewal,
    TransferError,
    iter_pages,
)
from kvtransfer.host_staging import HostStaging, StagedLayer
from kvtransfer.page_codec import (
    batch_pages,
    commit_from_proto,
    commit_to_proto,
    decode_request,
    encode_commit,
    encode_pages,
)
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.tls import open_channel

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    # Page streams are bulk data: larger HTTP/2 frames and flow-control windows cut per-frame work.
    ("grpc.http2.max_frame_size", 16 << 20 - 1),
    ("grpc.http2.bdp_probe", 1),
    ("grpc.http2.lookahead_bytes", 64 << 20),
    # The minimum connect timeout (20 s by default): a decode node whose host is gone fails the
    # push after 2 s, and the gateway retries the request elsewhere.
    ("grpc.min_reconnect_backoff_ms", 2000),
]


PUSH_KV = "/pdserve.v1.KvTransferService/PushKv"


class GrpcKvSender(KvSender):
    """Keeps one channel per decode address; `interceptors` go on each (the cluster secret's), and
    with `credentials` each is TLS (protos/tls.py). A cache off the CPU is read through a
    HostStaging for its device; `stage_host_caches` sends a CPU cache that way too (tests)."""

    def __init__(
        self,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        credentials: grpc.ChannelCredentials | None = None,
        stage_host_caches: bool = False,
    ) -> None:
        self._interceptors = list(interceptors)
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stage_host_caches = stage_host_caches
        self._staging: dict[torch.device, HostStaging] = {}

    def staging_for(self, kv_caches) -> HostStaging | None:
        """The staging for the cache's device; None where the pages can be read in place."""
        device = kv_caches[0][0].device
        if device.type == "cpu" and not self._stage_host_caches:
            return None
        if device not in self._staging:
            self._staging[device] = HostStaging(device)
        return self._staging[device]

    def open_stream(self, destination: KvDestination, kv_caches, request_id: str) -> GrpcKvStream:
        return GrpcKvStream(self, destination, kv_caches, request_id)

    async def commit(self, destination: KvDestination, commit: KvCommit) -> None:
        """The commit alone, in one unary call (the pages travelled another way)."""
        with _transfer_errors(f"commit to {destination.address} failed"):
            response = await self._stub(destination.address).CommitKv(commit_to_proto(commit))
        if not response.ok:
            raise TransferError(response.error)

    async def get_reservation(self, address: str, token: str, timeout_s: float) -> KvDestination:
        request = kv_transfer_pb2.GetReservationRequest(reservation_token=token)
        with _transfer_errors(f"reservation at {address}"):
            answer = await self._stub(address).GetReservation(request, timeout=timeout_s)
        shm = (answer.shm_name, answer.host_id, answer.kv_layout)
        return KvDestination(
            address,
            tuple(answer.block_ids),
            *shm,
            num_cached_blocks=answer.num_cached_blocks,
            cuda_ipc_handle=answer.cuda_ipc_handle,
        )

    async def renew_leases(self, address: str, request_ids: list[str], timeout_s: float) -> LeaseRenewal:
        request = kv_transfer_pb2.RenewLeasesRequest(request_ids=request_ids)
        with _transfer_errors(f"renewal at {address} failed"):
            response = await self._stub(address).RenewLeases(request, timeout=timeout_s)
        return LeaseRenewal(list(response.released_request_ids), response.lease_ms / 1000)

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KvTransferServiceStub:
        # The generated stub serves the unary calls; PushKv keeps its own encoder (page_codec).
        return kv_transfer_pb2_grpc.KvTransferServiceStub(self._channel(address))

    async def _push(self, address: str, messages) -> None:
        # Messages arrive encoded (bytes): the sender controls every copy of the page data.
        push_kv = self._channel(address).stream_unary(
            PUSH_KV, request_serializer=None, response_deserializer=kv_transfer_pb2.PushKvResponse.FromString
        )
        try:
            response = await push_kv(messages)
        except grpc.aio.AioRpcError as error:
            raise TransferError(f"push to {address} failed: {error.code().name} {error.details()}") from error
        if not response.ok:
            raise TransferError(response.error)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self._credentials, GRPC_OPTIONS, self._interceptors)
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
        self.staging = sender.staging_for(kv_caches)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.staged: list[StagedLayer] = []  # buffers to hand back if the stream ends early
        self.call = asyncio.create_task(sender._push(destination.address, self._messages()))

    def send_layer(self, layer: int, block_ids: list[int]) -> None:
        """On the engine thread: a host cache's pages are encoded now; a GPU cache's start their
        copy to host memory, and the event loop encodes them once it lands."""
        if self.staging is not None:
            item = self.staging.stage(self.kv_caches, self.request_id, layer, block_ids)
        else:
            layer_pages = iter_pages(self.kv_caches, self.request_id, block_ids, layers=range(layer, layer + 1))
            item = [encode_pages(pages) for pages in batch_pages(layer_pages)]
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (item, False))

    async def commit(self, commit: KvCommit) -> None:
        # Through the loop's callback queue, so that the commit goes after the pages that
        # send_layer has queued the same way, even when both are called on the loop's thread.
        self.loop.call_soon(self.queue.put_nowait, ([encode_commit(commit)], True))
        await self.call

    def cancel(self) -> None:
        self.call.cancel()

    async def _messages(self):
        try:
            while True:
                item, last = await self.queue.get()
                messages = await self._encode_staged(item) if isinstance(item, StagedLayer) else item
                for message in messages:
                    yield message
                if last:
                    return
        finally:
            self._release_staged()

    async def _encode_staged(self, staged: StagedLayer) -> list[bytes]:
        self.staged.append(staged)
        await staged.wait()
        messages = [encode_pages(pages) for pages in batch_pages(staged.pages(MAX_MESSAGE_BYTES))]
        staged.release()  # the bytes are in the messages now
        return messages

    def _release_staged(self) -> None:
        """A stream that ended early (cancelled, failed) still hands back what it staged; a
        layer whose copy may still be running is left to the garbage collector, not reused."""
        while not self.queue.empty():
            item, _ = self.queue.get_nowait()
            if isinstance(item, StagedLayer):
                self.staged.append(item)
        for staged in self.staged:
            if staged.copied is None or staged.copied.query():
                staged.release()


class KvTransferServicer:
    """Decode side: feeds every pushed message to the receiver; the first error ends the stream.
    `shared_kv` (name, host id, layout of the KV cache's shared-memory segment) is offered to
    senders that ask for a reservation, when the cache lives in one; `cuda_ipc_handle`, when it
    lives on a GPU and was exported (the host id and layout then describe it)."""

    def __init__(
        self, receiver: KvReceiver, shared_kv: tuple[str, str, str] = ("", "", ""), cuda_ipc_handle: bytes = b""
    ) -> None:
        self.receiver = receiver
        self.shared_kv = shared_kv
        self.cuda_ipc_handle = cuda_ipc_handle

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers both methods; PushKv messages are decoded by page_codec (pages as views)."""
        respond = kv_transfer_pb2.PushKvResponse.SerializeToString
        handlers = {
            "PushKv": grpc.stream_unary_rpc_method_handler(
                self.PushKv, request_deserializer=decode_request, response_serializer=respond
            ),
            "CommitKv": grpc.unary_unary_rpc_method_handler(
                self.CommitKv, request_deserializer=kv_transfer_pb2.KvCommit.FromString, response_serializer=respond
            ),
            "RenewLeases": grpc.unary_unary_rpc_method_handler(
                self.RenewLeases,
                request_deserializer=kv_transfer_pb2.RenewLeasesRequest.FromString,
                response_serializer=kv_transfer_pb2.RenewLeasesResponse.SerializeToString,
            ),
            "GetReservation": grpc.unary_unary_rpc_method_handler(
                self.GetReservation,
                request_deserializer=kv_transfer_pb2.GetReservationRequest.FromString,
                response_serializer=kv_transfer_pb2.GetReservationResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("pdserve.v1.KvTransferService", handlers),)
        )

    async def PushKv(self, request_iterator, context) -> kv_transfer_pb2.PushKvResponse:
        try:
            async for item in request_iterator:  # a batch of pages or the commit
                if isinstance(item, KvCommit):
                    self.receiver.commit(item)
                else:
                    for page in item:
                        self.receiver.receive_page(page)
        except TransferError as error:
            return kv_transfer_pb2.PushKvResponse(ok=False, error=str(error))
        return kv_transfer_pb2.PushKvResponse(ok=True)

    async def CommitKv(self, request: kv_transfer_pb2.KvCommit, context) -> kv_transfer_pb2.PushKvResponse:
        try:
            self.receiver.commit(commit_from_proto(request))
        except TransferError as error:
            return kv_transfer_pb2.PushKvResponse(ok=False, error=str(error))
        return kv_transfer_pb2.PushKvResponse(ok=True)

    async def RenewLeases(self, request: kv_transfer_pb2.RenewLeasesRequest, context):
        renewal = self.receiver.renew(request.request_ids)
        return kv_transfer_pb2.RenewLeasesResponse(
            released_request_ids=renewal.released_request_ids, lease_ms=round(renewal.lease_s * 1000)
        )

    async def GetReservation(self, request: kv_transfer_pb2.GetReservationRequest, context):
        try:
            block_ids, num_cached_blocks = self.receiver.reservation(request.reservation_token)
        except TransferError:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no open reservation has this token")
        shm_name, host_id, kv_layout = self.shared_kv
        return kv_transfer_pb2.GetReservationResponse(
            block_ids=block_ids,
            num_cached_blocks=num_cached_blocks,
            shm_name=shm_name,
            host_id=host_id,
            kv_layout=kv_layout,
            cuda_ipc_handle=self.cuda_ipc_handle,
        )


@contextlib.contextmanager
def _transfer_errors(what: str) -> Iterator[None]:
    """A failed unary call to the decode node as a TransferError saying what failed and why."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise TransferError(f"{what}: {error.code().name} {error.details()}") from error
