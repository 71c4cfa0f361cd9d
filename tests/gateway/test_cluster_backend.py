"""ClusterBackend over scripted prefill and decode nodes (real gRPC servers in this process):
a failed call is blamed on the node that made it, only that node is routed around, and every
attempt releases its place in the router's in-flight counts and its decode reservation."""

from __future__ import annotations

import asyncio
import socket
import uuid
from contextlib import asynccontextmanager

import grpc
import pytest

from gateway.backend import BackendError, BackendErrorKind
from gateway.cluster_backend import ClusterBackend
from gateway.router import Router
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo
from pdserve.engine.sampling_params import SamplingParams
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

PROMPT = list(range(40))
FIRST_TOKEN, DECODED_TOKENS = 7, [8, 9]
# Reservation name -> set once a prefill node "pushed" its pages (names are unique per reservation).
PAGES_ARRIVED: dict[str, asyncio.Event] = {}


class ScriptedDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Reserves, waits for a prefill node to push the pages, then streams DECODED_TOKENS; or
    aborts with `fail` before reserving (`fail_after_reserved`: once the pages are in); with
    `hang`, it decodes forever once the pages are in. `ended` records how each call ended."""

    def __init__(
        self, fail: grpc.StatusCode | None = None, fail_after_reserved: bool = False, hang: bool = False
    ) -> None:
        self.fail = fail
        self.fail_after_reserved = fail_after_reserved
        self.hang = hang
        self.ended: list[tuple[str, str]] = []  # (request id, "finished" | "cancelled" | "failed")

    async def Generate(self, request, context):
        try:
            if self.fail is not None and not self.fail_after_reserved:
                self.ended.append((request.request_id, "failed"))
                await context.abort(self.fail, "decode node going away")
            name = uuid.uuid4().hex
            arrived = PAGES_ARRIVED.setdefault(name, asyncio.Event())
            yield decode_pb2.GenerateResponse(
                reserved=decode_pb2.Reserved(num_blocks=3, block_ids=[0, 1, 2], shm_name=name)
            )
            try:
                await arrived.wait()
            finally:
                del PAGES_ARRIVED[name]
            if self.fail is not None:
                self.ended.append((request.request_id, "failed"))
                await context.abort(self.fail, "decode node going away")
            if self.hang:
                await asyncio.Event().wait()
            for i, token in enumerate(DECODED_TOKENS):
                last = i == len(DECODED_TOKENS) - 1
                chunk = decode_pb2.TokenChunk(token_ids=[token], finish_reason="length" if last else "")
                yield decode_pb2.GenerateResponse(chunk=chunk)
            self.ended.append((request.request_id, "finished"))
        except asyncio.CancelledError:  # the gateway cancelled the call: a real node frees the blocks here
            self.ended.append((request.request_id, "cancelled"))
            raise


class ScriptedPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Pushes the pages and answers FIRST_TOKEN, or aborts with `fail`; records the decode
    address of each call."""

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.fail = fail
        self.decode_addresses: list[str] = []

    async def Prefill(self, request, context):
        self.decode_addresses.append(request.decode_address)
        if self.fail is not None:
            await context.abort(self.fail, "prefill node going away")  # no address: blame comes from the call
        PAGES_ARRIVED[request.decode_shm_name].set()
        return prefill_pb2.PrefillResponse(first_token_id=FIRST_TOKEN)


class FixedRegistry:
    def __init__(self, nodes: list[NodeInfo]) -> None:
        self._nodes = nodes

    def nodes(self, role=None):
        return sorted((n for n in self._nodes if role is None or n.role == role), key=lambda n: n.node_id)


def node_info(node_id: str, role: str, address: str) -> NodeInfo:
    capacity = NodeCapacity(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    return NodeInfo(node_id=node_id, role=role, address=address, model="m", capacity=capacity)


def dead_address() -> str:
    """A loopback port where nothing listens: a killed node."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def cluster(**servicers):
    """One gRPC server per scripted node (node_id -> servicer, or None for a dead node); yields
    the backend over them."""
    servers, nodes = [], []
    for node_id, servicer in servicers.items():
        role = "prefill" if node_id.startswith("p") else "decode"
        if servicer is None:
            nodes.append(node_info(node_id, role, dead_address()))
            continue
        server = grpc.aio.server()
        add = prefill_pb2_grpc.add_PrefillServiceServicer_to_server if role == "prefill" else None
        (add or decode_pb2_grpc.add_DecodeServiceServicer_to_server)(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        nodes.append(node_info(node_id, role, f"127.0.0.1:{port}"))
    backend = ClusterBackend(FixedRegistry(nodes), Router(FixedRegistry(nodes)))
    try:
        yield backend
    finally:
        await backend.close()
        for server in servers:
            await server.stop(0)


async def generate(backend: ClusterBackend, num_chunks: int | None = None) -> list:
    """The tokens of every chunk (or of the first `num_chunks`, closing the stream early)."""
    chunks = []
    stream = backend.generate("req", PROMPT, SamplingParams(max_tokens=3))
    try:
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == num_chunks:
                break
    finally:
        await stream.aclose()
    return chunks


def assert_released(backend: ClusterBackend) -> None:
    assert not backend.router.in_flight and not backend.router.in_flight_tokens


@pytest.mark.parametrize("how", ["refuses", "dead"])
def test_a_failing_prefill_node_is_retried_on_another_with_the_same_decode_node(how):
    decode, good = ScriptedDecode(), ScriptedPrefill()
    bad = ScriptedPrefill(fail=grpc.StatusCode.UNAVAILABLE) if how == "refuses" else None

    async def main():
        async with cluster(p0=bad, p1=good, d0=decode) as backend:  # p0 first: same work, lower id
            chunks = await generate(backend)
            assert_released(backend)
            return chunks, backend.registry.nodes("decode")[0].address

    chunks, decode_address = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [[FIRST_TOKEN], *([t] for t in DECODED_TOKENS)]
    assert chunks[0].route.startswith("prefill=p1; decode=d0")
    assert good.decode_addresses == [decode_address]
    if bad is not None:
        assert bad.decode_addresses == [decode_address]
    # The first attempt's reservation was cancelled (the decode node freed its blocks), the second finished.
    assert decode.ended == [("req", "cancelled"), ("req", "finished")]


def test_a_failing_decode_node_is_routed_around_and_the_prefill_node_stays_eligible():
    prefill, bad, good = ScriptedPrefill(), ScriptedDecode(fail=grpc.StatusCode.UNAVAILABLE), ScriptedDecode()

    async def main():
        async with cluster(p0=prefill, d0=bad, d1=good) as backend:  # d0 first: same load, lower id
            chunks = await generate(backend)
            assert_released(backend)
            return chunks, {n.node_id: n.address for n in backend.registry.nodes()}

    chunks, addresses = asyncio.run(main())
    assert chunks[0].route.startswith("prefill=p0; decode=d1")
    assert [c.token_ids for c in chunks] == [[FIRST_TOKEN], *([t] for t in DECODED_TOKENS)]
    assert prefill.decode_addresses == [addresses["d1"]]  # d0 failed before its prefill was called
    assert (bad.ended, good.ended) == ([("req", "failed")], [("req", "finished")])


def test_when_every_node_of_a_role_fails_the_last_failure_is_reported():
    failing = [ScriptedPrefill(fail=grpc.StatusCode.UNAVAILABLE) for _ in range(2)]
    decode = ScriptedDecode()

    async def main():
        async with cluster(p0=failing[0], p1=failing[1], d0=decode) as backend:
            with pytest.raises(BackendError) as raised:
                await generate(backend)
            assert_released(backend)
            return raised.value

    error = asyncio.run(main())
    assert error.kind == BackendErrorKind.UNAVAILABLE
    assert error.message == "prefill node p1: unavailable: prefill node going away"
    assert [len(p.decode_addresses) for p in failing] == [1, 1]
    assert decode.ended == [("req", "cancelled"), ("req", "cancelled")]


def test_a_refused_request_is_not_retried():
    prefill = ScriptedPrefill(fail=grpc.StatusCode.INVALID_ARGUMENT)
    other, decode = ScriptedPrefill(), ScriptedDecode()

    async def main():
        async with cluster(p0=prefill, p1=other, d0=decode) as backend:
            with pytest.raises(BackendError) as raised:
                await generate(backend)
            assert_released(backend)
            return raised.value

    assert asyncio.run(main()).kind == BackendErrorKind.INVALID_REQUEST
    assert other.decode_addresses == []
    assert decode.ended == [("req", "cancelled")]


def test_a_decode_node_failing_after_the_first_token_ends_the_request():
    prefill, decode = ScriptedPrefill(), ScriptedDecode(fail=grpc.StatusCode.UNAVAILABLE, fail_after_reserved=True)
    spare = ScriptedDecode()

    async def main():
        async with cluster(p0=prefill, d0=decode, d1=spare) as backend:
            stream = backend.generate("req", PROMPT, SamplingParams(max_tokens=3))
            assert (await anext(stream)).token_ids == [FIRST_TOKEN]
            with pytest.raises(BackendError, match="decode node d0: unavailable"):
                await anext(stream)
            assert_released(backend)

    asyncio.run(main())
    assert spare.ended == []  # the first token was sent: no retry elsewhere


def test_closing_the_stream_early_cancels_the_decode_call_and_releases_the_nodes():
    decode = ScriptedDecode(hang=True)

    async def main():
        async with cluster(p0=ScriptedPrefill(), d0=decode) as backend:
            assert [c.token_ids for c in await generate(backend, num_chunks=1)] == [[FIRST_TOKEN]]
            assert_released(backend)
            await asyncio.sleep(0.05)  # the cancellation reaches the decode node

    asyncio.run(main())
    assert decode.ended == [("req", "cancelled")]
