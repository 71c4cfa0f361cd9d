"""The gateway's backend over real nodes: gRPC to prefill and decode nodes found in Redis.

Lifecycle of one request (disaggregated):
  0. the router picks a prefill and a decode node (gateway/router.py: by policy, load and the
     prompt's cached prefix on each node);
  1. open the decode node's Generate stream; it reserves blocks and says `reserved` (how many
     leading blocks it holds already: only the rest will be pushed);
  2. pick a prefill node and call Prefill, naming the decode node; the first token comes back
     as soon as it is sampled and is streamed to the client at once;
  3. if it did not end the request, relay the decode node's token chunks until the last.
With colocated nodes (no prefill/decode split) step 2 is skipped: the node computes the
prompt itself. A node that refuses or fails before any token was sent is routed around: the call
that failed names its node (`NodeCallError`), and only that node is left out of the next attempt.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
from prometheus_client import Counter

from gateway.backend import BackendError, BackendErrorKind, GenerationChunk
from gateway.router import Route, Router
from pdserve.cluster_state.registry import NodeInfo, RegistryView
from pdserve.engine.sampling_params import SamplingParams
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from protos.convert import logprob_from_proto, sampling_params_to_proto

logger = logging.getLogger(__name__)

ROUTED_REQUESTS = Counter("pdserve_gateway_routed_requests", "Requests routed to each node", ["role", "node_id"])
PROMPT_TOKENS = Counter("pdserve_gateway_prefill_prompt_tokens", "Prompt tokens sent to each prefill node", ["node_id"])
CACHED_PROMPT_TOKENS = Counter(
    "pdserve_gateway_prefill_cached_tokens", "Prompt tokens each prefill node served from its prefix cache", ["node_id"]
)

MAX_ATTEMPTS = 3
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
STATUS_TO_KIND = {
    grpc.StatusCode.INVALID_ARGUMENT: BackendErrorKind.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BackendErrorKind.OVERLOADED,
}


class NodeCallError(Exception):
    """A gRPC call to one node failed: `node` is the node whose call raised, `error` what it raised."""

    def __init__(self, node: NodeInfo, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{node.role} node {node.node_id}: {error.code().name.lower()}: {error.details()}")
        self.node = node
        self.error = error

    @property
    def retryable(self) -> bool:
        return self.error.code() in RETRYABLE


@contextlib.contextmanager
def calling(node: NodeInfo) -> Iterator[None]:
    """Names the node in what a call to it raises (the router then avoids only that node)."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise NodeCallError(node, error) from error


class ClusterBackend:
    """Owns one gRPC channel per node address and the router's in-flight counts."""

    def __init__(self, registry: RegistryView, router: Router | None = None, kv_timeout_ms: int = 30_000) -> None:
        self.registry = registry
        self.router = router or Router(registry)
        self.kv_timeout_ms = kv_timeout_ms
        self._channels: dict[str, grpc.aio.Channel] = {}

    def num_nodes_by_role(self) -> dict[str, int]:
        return dict(collections.Counter(node.role for node in self.registry.nodes()))

    def is_ready(self) -> bool:
        if self.registry.nodes("colocated"):
            return True
        return bool(self.registry.nodes("prefill") and self.registry.nodes("decode"))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        failed_node_ids: set[str] = set()
        last_failure: NodeCallError | None = None
        for _ in range(MAX_ATTEMPTS):
            route = await self.router.route(prompt_token_ids, failed_node_ids)
            if route is None:
                break
            sent_any = False
            try:
                # aclosing: when the gateway stops early (stop string), cancel the node call now.
                async with contextlib.aclosing(self._run(request_id, prompt_token_ids, params, route)) as chunks:
                    async for chunk in chunks:
                        sent_any = True
                        yield chunk
                return
            except NodeCallError as failure:
                if sent_any or not failure.retryable:
                    raise _backend_error(failure) from failure
                last_failure = failure
                failed_node_ids.add(failure.node.node_id)  # the other node of the route stays eligible
                logger.warning("request %s: %s, routing around it", request_id, failure)
        if last_failure is not None:
            raise _backend_error(last_failure)
        raise BackendError(BackendErrorKind.UNAVAILABLE, "no healthy prefill and decode nodes are registered")

    async def _run(self, rid, prompt, params, route: Route) -> AsyncIterator[GenerationChunk]:
        prefill, decode = route.prefill, route.decode
        call = decode_pb2_grpc.DecodeServiceStub(self._channel(decode.address)).Generate(
            decode_pb2.GenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(params),
                local_prefill=prefill is None,
                kv_timeout_ms=self.kv_timeout_ms,
            )
        )
        for node in route.nodes:
            ROUTED_REQUESTS.labels(node.role, node.node_id).inc()
        lease = self.router.acquire(route, len(prompt))  # released in `finally`, whatever happens
        try:
            reserved = (await _read(call, decode)).reserved  # blocks are held on the decode node
            if prefill is not None:
                try:
                    first = await self._prefill(prefill, decode, reserved, rid, prompt, params)
                finally:
                    lease.prefill_done()
                first.route = route_header(
                    route, first.num_cached_tokens, reserved.num_cached_blocks * decode.capacity.block_size
                )
                yield first
                if first.finish_reason is not None:
                    return
            first_chunk = prefill is None
            while (message := await _read(call, decode)) is not grpc.aio.EOF:
                chunk = message.chunk
                output = GenerationChunk(
                    token_ids=list(chunk.token_ids),
                    logprobs=[logprob_from_proto(lp) for lp in chunk.logprobs],
                    finish_reason=chunk.finish_reason or None,
                    num_cached_tokens=chunk.num_cached_tokens,
                )
                if first_chunk:  # colocated: the node computed the prompt itself
                    output.route = route_header(route, chunk.num_cached_tokens, chunk.num_cached_tokens)
                    first_chunk = False
                yield output
                if chunk.finish_reason:
                    return
        finally:
            call.cancel()  # no-op once finished; otherwise the decode node aborts and frees blocks
            lease.release()

    async def _prefill(self, prefill: NodeInfo, decode: NodeInfo, reserved, rid, prompt, params) -> GenerationChunk:
        stub = prefill_pb2_grpc.PrefillServiceStub(self._channel(prefill.address))
        request = prefill_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(params),
            decode_address=decode.address,
            decode_block_ids=reserved.block_ids,
            decode_shm_name=reserved.shm_name,
            decode_host_id=reserved.host_id,
            decode_kv_layout=reserved.kv_layout,
            decode_num_cached_blocks=reserved.num_cached_blocks,
        )
        with calling(prefill):
            response = await stub.Prefill(request)
        PROMPT_TOKENS.labels(prefill.node_id).inc(len(prompt))
        CACHED_PROMPT_TOKENS.labels(prefill.node_id).inc(response.num_cached_tokens)
        logprobs = [logprob_from_proto(response.first_logprob)] if response.HasField("first_logprob") else []
        return GenerationChunk(
            [response.first_token_id], logprobs, response.finish_reason or None, response.num_cached_tokens
        )

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


def route_header(route: Route, prefill_cached_tokens: int, decode_cached_tokens: int) -> str:
    """The `x-pdserve-route` value: the nodes used and the prompt tokens each found cached."""
    prefill = route.prefill or route.decode
    return (
        f"prefill={prefill.node_id}; decode={route.decode.node_id}; "
        f"cached_tokens={prefill_cached_tokens}; decode_cached_tokens={decode_cached_tokens}"
    )


async def _read(call, decode: NodeInfo):
    """The decode node's next message (or EOF)."""
    with calling(decode):
        return await call.read()


def _backend_error(failure: NodeCallError) -> BackendError:
    return BackendError(STATUS_TO_KIND.get(failure.error.code(), BackendErrorKind.UNAVAILABLE), str(failure))
