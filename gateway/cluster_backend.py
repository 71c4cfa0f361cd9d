"""The gateway's backend over real nodes: gRPC to prefill and decode nodes found in Redis.

Lifecycle of one attempt (disaggregated):
  0. the router picks a prefill and a decode node (gateway/router.py: by policy, load and the
     prompt's cached prefix on each node);
  1. open the decode node's Generate stream (over its token stream where it advertises one: the
     same messages at a fraction of gRPC's CPU per token, protos/token_stream.py); it reserves
     blocks and says `reserved` (how many leading blocks it holds already: only the rest will be
     pushed);
  2. pick a prefill node and call Prefill, naming the decode node; the first token comes back
     as soon as it is sampled and is streamed to the client at once;
  3. if it did not end the request, relay the decode node's token chunks until the last.
With colocated nodes (no prefill/decode split) step 2 is skipped: the node computes the
prompt itself. A request runs as many attempts as gateway/failover.py allows: a node that fails
before any token was sent is routed around, and a stream that breaks after tokens were sent is
resumed on other nodes from the prompt plus those tokens.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter

from gateway.backend import GenerationChunk
from gateway.failover import Attempt, FailoverPolicy, NodeCallError, ResumableRequest, calling
from gateway.node_health import CHANNEL_OPTIONS
from gateway.router import Route, Router
from pdserve.cluster_state.registry import NodeInfo, RegistryView
from pdserve.cluster_state.secret import call_metadata
from pdserve.engine.sampling_params import SamplingParams
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from protos.convert import logprob_from_proto, sampling_params_to_proto
from protos.tls import open_channel
from protos.token_stream import TokenStreamCall

logger = logging.getLogger(__name__)

ROUTED_REQUESTS = Counter("pdserve_gateway_routed_requests", "Requests routed to each node", ["role", "node_id"])
PROMPT_TOKENS = Counter("pdserve_gateway_prefill_prompt_tokens", "Prompt tokens sent to each prefill node", ["node_id"])
CACHED_PROMPT_TOKENS = Counter(
    "pdserve_gateway_prefill_cached_tokens", "Prompt tokens each prefill node served from its prefix cache", ["node_id"]
)


class ClusterBackend:
    """Owns one gRPC channel per node address and the router's in-flight counts; with a cluster
    secret, every call it makes carries it, and with `credentials` the channels are TLS (and with
    `ssl_context`, the token streams)."""

    def __init__(
        self,
        registry: RegistryView,
        router: Router | None = None,
        failover: FailoverPolicy | None = None,
        cluster_secret: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.registry = registry
        self._metadata = call_metadata(cluster_secret)
        self._credentials = credentials
        self._ssl_context = ssl_context
        self.router = router or Router(registry)
        self.failover = failover or FailoverPolicy()
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
        request = ResumableRequest(request_id, prompt_token_ids, params, self.failover)
        while request.num_tokens_left > 0:
            attempt = request.next_attempt()
            route = await self._route(attempt, request.failed_node_ids)
            if route is None:
                raise request.no_route_error()
            try:
                # aclosing: when the gateway stops early (stop string), cancel the node call now.
                async with contextlib.aclosing(self._run(attempt, route)) as chunks:
                    async for chunk in chunks:
                        yield request.record(chunk)
                return
            except NodeCallError as failure:
                request.after_failure(failure)  # raises when no other attempt may run
                logger.warning("request %s: %s; attempt %d elsewhere", request_id, failure, request.num_attempts + 1)
        # Every token was sent but the stream broke before it said so.
        yield GenerationChunk([], finish_reason="length")

    async def _route(self, attempt: Attempt, failed_node_ids: set[str]) -> Route | None:
        """Nodes that have not failed this request; if every node of a role has, any registered
        ones: a failure may have been passing (a node that dropped one reservation), a dead node
        leaves the registry within its TTL, and the attempt bound still holds."""
        route = await self.router.route(attempt.prompt_token_ids, failed_node_ids)
        if route is None and failed_node_ids:
            route = await self.router.route(attempt.prompt_token_ids)
        return route

    async def _run(self, attempt: Attempt, route: Route) -> AsyncIterator[GenerationChunk]:
        rid, prompt, params = attempt.request_id, attempt.prompt_token_ids, attempt.params
        prefill, decode = route.prefill, route.decode
        call = self._generate_call(
            decode,
            decode_pb2.GenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(params),
                local_prefill=prefill is None,
            ),
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
            raise NodeCallError(decode, grpc.StatusCode.UNAVAILABLE, "the stream ended before its last chunk")
        finally:
            call.cancel()  # no-op once finished; otherwise the decode node aborts and frees blocks
            lease.release()

    def _generate_call(self, decode: NodeInfo, request: decode_pb2.GenerateRequest):
        """The decode node's Generate stream: both kinds read alike and fail with AioRpcError."""
        if decode.token_stream_address:
            return TokenStreamCall(decode.token_stream_address, request, self._metadata, self._ssl_context)
        return decode_pb2_grpc.DecodeServiceStub(self._channel(decode.address)).Generate(
            request, metadata=self._metadata
        )

    async def _prefill(self, prefill: NodeInfo, decode: NodeInfo, reserved, rid, prompt, params) -> GenerationChunk:
        stub = prefill_pb2_grpc.PrefillServiceStub(self._channel(prefill.address))
        request = prefill_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(params),
            decode_address=decode.address,
            reservation_token=reserved.reservation_token,  # the decode node tells the prefill node the rest
        )
        try:
            with calling(prefill):
                response = await stub.Prefill(request, metadata=self._metadata)
        except NodeCallError as failure:
            if failure.code == grpc.StatusCode.ABORTED:  # the decode node let the reservation go: its fault
                raise NodeCallError(decode, failure.code, str(failure)) from failure
            raise
        PROMPT_TOKENS.labels(prefill.node_id).inc(len(prompt))
        CACHED_PROMPT_TOKENS.labels(prefill.node_id).inc(response.num_cached_tokens)
        logprobs = [logprob_from_proto(response.first_logprob)] if response.HasField("first_logprob") else []
        return GenerationChunk(
            [response.first_token_id], logprobs, response.finish_reason or None, response.num_cached_tokens
        )

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            # Short reconnect backoff: a node restarted on the same address is reachable again soon.
            self._channels[address] = open_channel(address, self._credentials, CHANNEL_OPTIONS)
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
