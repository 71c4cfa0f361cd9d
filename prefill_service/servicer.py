"""The prefill node's gRPC servicer.

Lifecycle of one Prefill call:
  0. ask the decode node named in the request for the reservation of its token (block ids,
     cached blocks, shared-memory segment): the caller names none of them, so a Prefill call
     can write only into blocks that decode node reserved, under that token;
  1. open a layer-wise KV stream to the decode node (shared memory on the same host, else a
     gRPC page stream) and hold the decode node's reservation under a lease that this node
     renews while the prompt waits or is computed (kvtransfer/lease_keeper.py says why);
  2. the prompt joins the engine with max_tokens=1 and its KV blocks held after it finishes
     (the scheduler batches it with other prompts; chunked prefill applies); in the step that
     completes the prompt, each layer's pages are handed to the stream as soon as that layer
     is computed, so the transfer overlaps the rest of the forward pass;
  3. the first token is sampled here and returned to the gateway at once;
  4. unless that token already ends the request (then the stream is dropped), a background
     task commits the first token on the stream; the blocks and the lease are released when
     the commit is done or failed.
If the decode side gives up first (the lease is lost: the client went away, the decode node
died or failed the transfer), the prompt is dropped from the engine, queued or half computed,
and the call fails ABORTED; a cancelled call is dropped the same way. Either way the push,
the lease and the blocks are released at once (`_drop`).
The engine knows each call by its own id (request id + a counter), so a gateway that resends
a request id while the first call is still being released never mixes up the two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Protocol

import grpc

from kvtransfer.base import KvCommit, KvSender, KvStream, TransferError
from kvtransfer.lease_keeper import Lease, LeaseKeeper
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import HeldPrompt
from pdserve.engine.sampling_params import SamplingParams
from protos import prefill_pb2, prefill_pb2_grpc
from protos.convert import logprob_to_proto, sampling_params_from_proto

logger = logging.getLogger(__name__)


def finish_reason_after_first_token(
    params: SamplingParams, eos_token_ids: tuple[int, ...], token_id: int
) -> str | None:
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if params.max_tokens <= 1:
        return "length"
    return None


# How long the decode node may take to say where a reservation's pages go.
GET_RESERVATION_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class _Push:
    """One request's transfer: its stream, and how many leading blocks the decode node holds
    already (delta transfer: those are not sent)."""

    stream: KvStream
    num_skipped_blocks: int = 0


async def unless_lost(awaitable, lease: Lease):
    """The awaitable's result, or None if the lease is lost first (the awaitable is cancelled then)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, lease.lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # no-op once done
    return task.result() if task.done() and not task.cancelled() else None


class KvPushes:
    """The open layer-wise pushes by request id. The servicer adds and removes them on the event
    loop; `on_layer_computed`, the engine's layer hook, reads them on the engine thread."""

    def __init__(self) -> None:
        self._by_request: dict[str, _Push] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, request_id: str, stream: KvStream, num_skipped_blocks: int) -> None:
        self._by_request[request_id] = _Push(stream, num_skipped_blocks)

    def stream(self, request_id: str) -> KvStream:
        return self._by_request[request_id].stream

    def pop(self, request_id: str) -> KvStream | None:
        push = self._by_request.pop(request_id, None)
        return push.stream if push is not None else None

    def on_layer_computed(self, layer: int, held: list[HeldPrompt]) -> None:
        """Engine thread, between two layers: hand this layer's pages to each request's stream."""
        for prompt in held:
            push = self._by_request.get(prompt.request_id)
            if push is None:
                continue
            try:
                push.stream.send_layer(layer, prompt.block_ids[push.num_skipped_blocks :])
            except Exception:  # a broken transfer must not break the batch: its commit will fail
                logger.exception("sending layer %d of %s failed", layer, prompt.request_id)


class DecodeNodeDirectory(Protocol):
    """Which addresses are decode nodes of this cluster (prefill_service/server.py reads the signed
    registry): a Prefill naming any other address is refused before anything dials it."""

    async def is_decode_node(self, address: str) -> bool: ...


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Serves Prefill calls; the engine must have been built with `pushes.on_layer_computed` as
    its layer hook, so that pages leave as each layer is computed. With `decode_nodes`, only
    addresses it vouches for are dialed."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        sender: KvSender,
        pushes: KvPushes,
        leases: LeaseKeeper | None = None,
        decode_nodes: DecodeNodeDirectory | None = None,
    ) -> None:
        self.async_engine = async_engine
        self.sender = sender
        self.pushes = pushes
        self.leases = leases or LeaseKeeper(sender)
        self.decode_nodes = decode_nodes
        self.kv_caches = async_engine.engine.kv_caches
        self.eos_token_ids = async_engine.engine.eos_token_ids
        self._commits: set[asyncio.Task] = set()
        self._call_counter = itertools.count()
        self.num_pushes = 0  # ended pushes, their failures and summed time: the node's KV transfer stats
        self.num_push_failures = 0
        self.push_seconds = 0.0

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        rid = request.request_id
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        token = request.reservation_token  # the transfer's name at the decode node, not the request id
        if self.decode_nodes is not None and not await self.decode_nodes.is_decode_node(request.decode_address):
            # Dialing it would hand an arbitrary socket this node's calls (and its cluster secret).
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "decode_address is not a registered decode node")
        try:
            destination = await self.sender.get_reservation(request.decode_address, token, GET_RESERVATION_TIMEOUT_S)
            stream = self.sender.open_stream(destination, self.kv_caches, token)
        except TransferError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        key = f"{rid}#{next(self._call_counter)}"  # this call's id in the engine and in pushes
        self.pushes.add(key, stream, destination.num_cached_blocks)
        lease = self.leases.hold(token, destination.address)
        try:
            output = await self._first_token(key, list(request.prompt_token_ids), params, lease, context)
        except BaseException:  # refused, cancelled or lost: nothing will be pushed
            self._drop(key, lease)
            raise
        token_id = output.new_token_ids[0]
        logprob = output.new_logprobs[0] if output.new_logprobs else None
        reason = finish_reason_after_first_token(params, self.eos_token_ids, token_id)
        logger.debug("request %s: first token; pages go to %s", rid, request.decode_address)
        if reason is None:
            self._start_commit(key, lease, KvCommit(token, token_id, logprob))
        else:
            self._drop(key, lease)
        response = prefill_pb2.PrefillResponse(
            first_token_id=token_id,
            finished=reason is not None,
            finish_reason=reason or "",
            num_cached_tokens=output.num_cached_tokens,
        )
        if logprob is not None:
            response.first_logprob.CopyFrom(logprob_to_proto(logprob))
        return response

    async def _first_token(self, key: str, prompt: list[int], params: SamplingParams, lease: Lease, context):
        outputs = self.async_engine.open_stream(key)
        prefill_params = dataclasses.replace(params, max_tokens=1)

        async def add_and_wait():
            await self.async_engine.call(lambda engine: engine.add_request(key, prompt, prefill_params, hold_kv=True))
            return await outputs.get()

        try:
            # Lost while the add still waits for the engine thread: the abort queued by `_drop`
            # runs right after it, before any step computes the prompt.
            output = await unless_lost(add_and_wait(), lease)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            self.async_engine.close_stream(key)
        if output is None:
            await context.abort(grpc.StatusCode.ABORTED, f"dropped before its first token: {lease.lost.result()}")
        return output

    def _drop(self, key: str, lease: Lease) -> None:
        """Releases what this node holds for the call: its push, its lease, and its blocks (the
        abort also frees held ones; queued behind an add that may still be on its way, it runs
        after it)."""
        stream = self.pushes.pop(key)
        if stream is not None:
            stream.cancel()
        self.leases.release(lease)
        self.async_engine.submit(lambda engine: engine.abort(key))

    def _start_commit(self, key: str, lease: Lease, commit: KvCommit) -> None:
        task = asyncio.create_task(self._commit(key, lease, commit), name=f"commit-{key}")
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def _commit(self, key: str, lease: Lease, commit: KvCommit) -> None:
        started = time.monotonic()
        try:
            await self.pushes.stream(key).commit(commit)
            logger.debug("request %s: pages committed", commit.request_id)
        except (TransferError, asyncio.CancelledError) as error:
            self.num_push_failures += 1
            logger.warning("KV transfer of %s failed: %s", commit.request_id, error)
        finally:
            self.num_pushes += 1
            self.push_seconds += time.monotonic() - started
            self.pushes.pop(key)
            self.leases.release(lease)
            self.async_engine.submit(lambda engine: engine.release_kv(key))

    async def close(self) -> None:
        for task in list(self._commits):
            task.cancel()
        await self.leases.close()
        await self.sender.close()
