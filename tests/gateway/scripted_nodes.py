"""Scripted prefill and decode nodes (real gRPC servers in this process) and a ClusterBackend over
them, for the gateway's retry and failover tests. A scripted decode node also serves its Generate
on a token stream (decode_service/token_stream_server.py), which it advertises when
`DECODE_TRANSPORT` says so: test_cluster_backend.py runs its tests over both."""

from __future__ import annotations

import asyncio
import socket
import uuid
from contextlib import asynccontextmanager

import grpc

from decode_service.token_stream_server import TokenStreamServer
from gateway.cluster_backend import ClusterBackend
from gateway.failover import FailoverPolicy
from gateway.router import Router
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo
from pdserve.engine.sampling_params import SamplingParams
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

PROMPT = list(range(40))
# The scripted nodes' "model": output position i is SCRIPT[i], whichever node computes it. Nodes
# know the position from num_prior_output_tokens, so a resumed stream continues the same list.
SCRIPT = list(range(100, 164))
# Reservation name -> set once a prefill node "pushed" its pages (names are unique per reservation).
PAGES_ARRIVED: dict[str, asyncio.Event] = {}
TRANSPORTS = ("grpc", "token_stream")
DECODE_TRANSPORT = "grpc"  # how the gateway reads the scripted decode nodes' Generate


class ScriptedDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Reserves, waits for a prefill node to push the pages, then streams the script from the
    position after the prefill node's first token up to max_tokens; or aborts with `fail` before
    reserving (`fail_after_reserved`: once the pages are in); `break_after`: aborts UNAVAILABLE
    after that many decoded chunks (a node dying mid-stream); `end_after`: ends the stream there
    without its last chunk; `hang`: decodes forever once the pages are in. Records each call's
    request and how it ended."""

    def __init__(
        self,
        fail: grpc.StatusCode | None = None,
        fail_after_reserved: bool = False,
        hang: bool = False,
        break_after: int | None = None,
        end_after: int | None = None,
        script: list[int] = SCRIPT,
    ) -> None:
        self.fail, self.fail_after_reserved, self.hang = fail, fail_after_reserved, hang
        self.break_after, self.end_after, self.script = break_after, end_after, script
        self.requests: list[decode_pb2.GenerateRequest] = []
        self.ended: list[tuple[str, str]] = []  # (request id, "finished" | "cancelled" | "failed" | "ended")

    async def Generate(self, request, context):
        self.requests.append(request)
        try:
            if self.fail is not None and not self.fail_after_reserved:
                self.ended.append((request.request_id, "failed"))
                await context.abort(self.fail, "decode node going away")
            name = uuid.uuid4().hex
            arrived = PAGES_ARRIVED.setdefault(name, asyncio.Event())
            yield decode_pb2.GenerateResponse(reserved=decode_pb2.Reserved(num_blocks=3, reservation_token=name))
            try:
                await arrived.wait()
            finally:
                del PAGES_ARRIVED[name]
            if self.fail is not None:
                self.ended.append((request.request_id, "failed"))
                await context.abort(self.fail, "decode node going away")
            if self.hang:
                await asyncio.Event().wait()
            async for message in self._decode(request, context):
                yield message
        except asyncio.CancelledError:  # the gateway cancelled the call: a real node frees the blocks here
            self.ended.append((request.request_id, "cancelled"))
            raise

    async def _decode(self, request, context):
        prior, max_tokens = request.sampling_params.num_prior_output_tokens, request.sampling_params.max_tokens
        for i in range(1, max_tokens):  # output 0 of this request is the prefill node's first token
            if i - 1 == self.break_after:
                self.ended.append((request.request_id, "failed"))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")
            if i - 1 == self.end_after:
                self.ended.append((request.request_id, "ended"))
                return
            last = i == max_tokens - 1
            chunk = decode_pb2.TokenChunk(token_ids=[self.script[prior + i]], finish_reason="length" if last else "")
            yield decode_pb2.GenerateResponse(chunk=chunk)
        self.ended.append((request.request_id, "finished"))


class ScriptedPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Pushes the pages and answers the script's token at the request's first position (the
    last one when max_tokens is 1: no push), or aborts with `fail` (its first `num_failures`
    calls only, if given); records each request."""

    def __init__(
        self, fail: grpc.StatusCode | None = None, num_failures: int | None = None, script: list[int] = SCRIPT
    ) -> None:
        self.fail, self.num_failures, self.script = fail, num_failures, script
        self.requests: list[prefill_pb2.PrefillRequest] = []

    @property
    def decode_addresses(self) -> list[str]:
        return [r.decode_address for r in self.requests]

    async def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail is not None and (self.num_failures is None or len(self.requests) <= self.num_failures):
            await context.abort(self.fail, "prefill node going away")  # no address: blame comes from the call
        params = request.sampling_params
        first = self.script[params.num_prior_output_tokens]
        if params.max_tokens == 1:
            return prefill_pb2.PrefillResponse(first_token_id=first, finished=True, finish_reason="length")
        PAGES_ARRIVED[request.reservation_token].set()
        return prefill_pb2.PrefillResponse(first_token_id=first)


class FixedRegistry:
    def __init__(self, nodes: list[NodeInfo]) -> None:
        self._nodes = nodes

    def nodes(self, role=None):
        return sorted((n for n in self._nodes if role is None or n.role == role), key=lambda n: n.node_id)


def node_info(node_id: str, role: str, address: str, token_stream_address: str = "") -> NodeInfo:
    capacity = NodeCapacity(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    if DECODE_TRANSPORT != "token_stream":
        token_stream_address = ""
    return NodeInfo(
        node_id=node_id,
        role=role,
        address=address,
        model="m",
        capacity=capacity,
        token_stream_address=token_stream_address,
    )


def dead_address() -> str:
    """A loopback port where nothing listens: a killed node."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def cluster(failover: FailoverPolicy | None = None, **servicers):
    """One gRPC server per scripted node (node_id -> servicer, or None for a dead node); yields
    the backend over them."""
    servers, token_streams, nodes = [], [], []
    for node_id, servicer in servicers.items():
        role = "prefill" if node_id.startswith("p") else "decode"
        if servicer is None:
            nodes.append(node_info(node_id, role, dead_address(), dead_address()))
            continue
        server = grpc.aio.server()
        add = prefill_pb2_grpc.add_PrefillServiceServicer_to_server if role == "prefill" else None
        (add or decode_pb2_grpc.add_DecodeServiceServicer_to_server)(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        token_stream_address = ""
        if role == "decode":
            token_streams.append(TokenStreamServer(servicer))
            token_stream_address = f"127.0.0.1:{await token_streams[-1].start('127.0.0.1', 0)}"
        nodes.append(node_info(node_id, role, f"127.0.0.1:{port}", token_stream_address))
    backend = ClusterBackend(FixedRegistry(nodes), Router(FixedRegistry(nodes)), failover=failover)
    try:
        yield backend
    finally:
        await backend.close()
        for token_stream in token_streams:
            await token_stream.stop(0)
        for server in servers:
            await server.stop(0)


async def generate(backend: ClusterBackend, num_chunks: int | None = None, max_tokens: int = 3, **sampling) -> list:
    """The chunks of the request (or its first `num_chunks`, closing the stream early)."""
    chunks = []
    stream = backend.generate("req", PROMPT, SamplingParams(max_tokens=max_tokens, **sampling))
    try:
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == num_chunks:
                break
    finally:
        await stream.aclose()
    return chunks


def tokens(chunks: list) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def assert_released(backend: ClusterBackend) -> None:
    assert not backend.router.in_flight and not backend.router.in_flight_tokens
