"""The decode node's gRPC servicer.

Lifecycle of one Generate stream:
  1. reserve KV blocks for the prompt, reusing the leading blocks this node has cached; if the
     pool is full, wait in turn for blocks to free up (reservation_queue.py), and only past
     `max_reserve_wait_s` fail with RESOURCE_EXHAUSTED; then send `reserved` with a random
     reservation token, so the gateway can start the prefill; the prefill node learns the
     block ids and segment from this node with the token, and pages, commits and renewals are
     accepted only under it; only the blocks after the cached ones are pushed;
  2. wait for the prefill node to push every page and commit the first token, for as long as
     the prefill node renews the reservation's lease (kvtransfer/lease_keeper.py says why a
     lease): a long queue there never fails the request; a lease that expires (the prefill
     node is gone, or never came) or a bad page frees the blocks and fails the call with
     UNAVAILABLE; the caller picks no deadline (the deprecated `kv_timeout_ms` is ignored);
  3. join the continuous batch at the next step boundary and stream the sampled tokens, a chunk
     per `stream_interval` tokens (the first and the last at once), the last chunk with its
     finish reason; the request leaves the batch as it finishes. On a token stream whose context
     has `write_response`, the engine thread writes the chunks itself, and this call only waits
     for the last one (AsyncEngine.write_directly).
However the call ends (done, failed, cancelled at any point), its blocks and its reservation
in the receiver are released, and the next waiter for blocks is woken. A request id is served
by one call at a time: a duplicate waits briefly for an earlier call that is being released (a
gateway retrying), and fails ALREADY_EXISTS, touching nothing, while the earlier one lives.
`local_prefill` (colocated mode) skips 1-2: the prompt is computed in this node's own batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from decode_service.reservation_queue import ReservationQueue
from kvtransfer.base import KvReceiver, TransferError, new_reservation_token
from pdserve.engine.async_engine import AsyncEngine, Written
from pdserve.engine.request import RequestOutput
from protos import decode_pb2, decode_pb2_grpc
from protos.convert import logprob_to_proto, sampling_params_from_proto

logger = logging.getLogger(__name__)

# A gateway that retries a request may reach this node again while the first call is still
# being released: the second waits this long for it.
MAX_PREVIOUS_CALL_WAIT_S = 1.0


def chunk_message(output: RequestOutput) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(
        chunk=decode_pb2.TokenChunk(
            token_ids=output.new_token_ids,
            logprobs=[logprob_to_proto(lp) for lp in output.new_logprobs],
            finish_reason=output.finish_reason or "",
            num_cached_tokens=output.num_cached_tokens,
        )
    )


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        async_engine: AsyncEngine,
        receiver: KvReceiver,
        max_reserve_wait_s: float,
        stream_interval: int = 1,
    ) -> None:
        self.async_engine = async_engine
        self.stream_interval = stream_interval
        self.receiver = receiver
        self.reservations = ReservationQueue(max_reserve_wait_s)
        self._request_id_to_released: dict[str, asyncio.Event] = {}  # one call per request id at a time

    async def Generate(self, request: decode_pb2.GenerateRequest, context):
        rid = request.request_id
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        released = await self._take_request_id(rid, context)
        stream = self.async_engine.open_stream(rid, self.stream_interval)
        finished, token = False, ""
        try:
            prompt = list(request.prompt_token_ids)
            if request.local_prefill:
                yield await self._add_local(rid, prompt, params, context)
            else:
                token = new_reservation_token()
                yield await self._reserve(rid, token, prompt, params, context)
                logger.debug("request %s: blocks reserved, awaiting pages", rid)
                final = await self._await_pages(rid, token, context)
                logger.debug("request %s: pages committed", rid)
                if final is not None:
                    finished = True
                    yield chunk_message(final)
                    return
            write_response = getattr(context, "write_response", None)
            num_received, writing_directly = 0, False
            while not finished:
                if write_response is not None and not writing_directly:
                    writing_directly = self.async_engine.write_directly(
                        rid, lambda output: write_response(chunk_message(output)), num_received
                    )
                output = await stream.get()
                num_received += 1
                if isinstance(output, Written):  # the engine thread wrote it, and those before it
                    finished = True
                    break
                finished = output.finished
                yield chunk_message(output)
        finally:
            logger.debug("request %s: %s", rid, "finished" if finished else "ended unfinished (cancelled or failed)")
            self.async_engine.close_stream(rid)
            if token:
                self.receiver.forget(token)
            if not finished:  # cancelled or failed: free the blocks (abort is a no-op if gone)
                self.async_engine.submit(lambda engine: engine.abort(rid))
            self.reservations.notify()  # its blocks are free, or will be before the next try runs
            del self._request_id_to_released[rid]
            released.set()

    async def _take_request_id(self, rid: str, context) -> asyncio.Event:
        """The event this call sets once it has released everything, after waiting (within a
        bound) for an earlier call with the same id to do so: releasing by id then never touches
        another call's request."""
        earlier = self._request_id_to_released.get(rid)
        if earlier is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(earlier.wait(), MAX_PREVIOUS_CALL_WAIT_S)
        if rid in self._request_id_to_released:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is in progress on this node")
        released = self._request_id_to_released[rid] = asyncio.Event()
        return released

    async def _add_local(self, rid, prompt, params, context) -> decode_pb2.GenerateResponse:
        try:
            await self.async_engine.call(lambda engine: engine.add_request(rid, prompt, params))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return decode_pb2.GenerateResponse(reserved=decode_pb2.Reserved(num_blocks=0))

    async def _reserve(self, rid, token, prompt, params, context) -> decode_pb2.GenerateResponse:
        def try_reserve():
            return self.async_engine.call(lambda engine: engine.reserve_prefilled(rid, prompt, params))

        try:
            reservation = await self.reservations.reserve(try_reserve)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if reservation is None:
            waited = f"{self.reservations.max_wait_s:.1f} s"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode node had no free KV blocks for {waited}")
        # Only the blocks not cached here already; nobody learns their ids but through the token.
        self.receiver.reserve(token, reservation.block_ids, reservation.num_cached_blocks)
        reserved = decode_pb2.Reserved(
            num_blocks=len(reservation.block_ids),
            num_cached_blocks=reservation.num_cached_blocks,
            reservation_token=token,
        )
        return decode_pb2.GenerateResponse(reserved=reserved)

    async def _await_pages(self, rid, token, context) -> RequestOutput | None:
        try:
            commit = await self.receiver.wait(token)
        except TransferError as error:
            logger.warning("request %s: %s", rid, error)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {error}")
        return await self.async_engine.call(
            lambda engine: engine.admit_prefilled(rid, commit.first_token_id, commit.first_logprob)
        )
