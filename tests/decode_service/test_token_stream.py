"""The token stream (protos/token_stream.py, decode_service/token_stream_server.py) beyond what
test_servicer.py runs over it: the cluster secret, TLS, a node stopping under open calls, a peer
that sends garbage, a node that is not there, and the sink that the engine thread writes to. The
calls fail as grpc.aio's would, so the gateway's failover treats both transports alike."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest

from decode_service.token_stream_server import FrameSink, TokenStreamServer
from pdserve.cluster_state.secret import call_metadata
from pdserve.engine import SamplingParams
from protos import decode_pb2
from protos.tls import GrpcTlsOptions
from protos.token_stream import HEADER, TokenStreamCall, encode_frame, read_frame
from tests.decode_service.inprocess_pair import Pair, generate_request, run
from tests.factories import build_test_certificates
from tests.gateway.scripted_nodes import dead_address

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def read_all(call) -> list[int]:
    """The tokens of a colocated call, after its `reserved` message."""
    assert (await call.read()).HasField("reserved")
    tokens = []
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens += message.chunk.token_ids
    return tokens


async def failure_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while await call.read() is not grpc.aio.EOF:
            pass
    return error.value.code()


def local_request(rid: str) -> decode_pb2.GenerateRequest:
    return generate_request(rid, list(range(3, 30)), PARAMS, local_prefill=True)


async def second_server(pair: Pair, **kw) -> tuple[TokenStreamServer, str]:
    server = TokenStreamServer(pair.token_stream.servicer, **kw)
    return server, f"127.0.0.1:{await server.start('127.0.0.1', 0)}"


def test_a_node_with_a_secret_answers_only_calls_that_carry_it(tiny_llama_path):
    async def scenario(pair: Pair):
        server, address = await second_server(pair, secret=SECRET)
        try:
            assert (
                await failure_code(TokenStreamCall(address, local_request("none"))) == grpc.StatusCode.UNAUTHENTICATED
            )
            wrong = TokenStreamCall(address, local_request("wrong"), call_metadata("not-it"))
            assert await failure_code(wrong) == grpc.StatusCode.UNAUTHENTICATED
            tokens = await read_all(TokenStreamCall(address, local_request("right"), call_metadata(SECRET)))
            assert len(tokens) == PARAMS.max_tokens
            assert await pair.is_idle()
        finally:
            await server.stop(0)

    run(tiny_llama_path, scenario)


def test_a_tls_node_serves_clients_of_its_ca_and_refuses_plaintext(tiny_llama_path, tmp_path):
    paths = build_test_certificates(tmp_path / "ours")
    tls = GrpcTlsOptions(grpc_tls_cert=paths["cert"], grpc_tls_key=paths["key"], grpc_tls_ca=paths["ca"])
    other = build_test_certificates(tmp_path / "theirs", "other-ca")
    stranger = GrpcTlsOptions(grpc_tls_cert=other["cert"], grpc_tls_key=other["key"], grpc_tls_ca=other["ca"])

    async def scenario(pair: Pair):
        server, address = await second_server(pair, ssl_context=tls.server_ssl_context())
        try:
            call = TokenStreamCall(address, local_request("tls"), ssl_context=tls.client_ssl_context())
            assert len(await read_all(call)) == PARAMS.max_tokens
            assert await failure_code(TokenStreamCall(address, local_request("plain"))) == grpc.StatusCode.UNAVAILABLE
            foreign = TokenStreamCall(address, local_request("foreign"), ssl_context=stranger.client_ssl_context())
            assert await failure_code(foreign) == grpc.StatusCode.UNAVAILABLE
            assert await pair.is_idle()
        finally:
            await server.stop(0)

    run(tiny_llama_path, scenario)


def test_stopping_the_node_cuts_open_calls_and_frees_their_blocks(tiny_llama_path):
    async def scenario(pair: Pair):
        server, address = await second_server(pair)
        long_request = generate_request("long", list(range(40)), SamplingParams(max_tokens=400, ignore_eos=True))
        long_request.local_prefill = True
        call = TokenStreamCall(address, long_request)
        await call.read()  # reserved
        await call.read()  # the first tokens: it is in the batch
        await server.stop(grace_s=0.2)
        assert await failure_code(call) == grpc.StatusCode.UNAVAILABLE  # no status frame: the gateway fails over
        assert server.num_open_calls == 0
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_a_peer_that_sends_garbage_is_closed_and_the_node_serves_on(tiny_llama_path):
    async def scenario(pair: Pair):
        reader, writer = await asyncio.open_connection("127.0.0.1", pair.token_stream_port)
        writer.write(HEADER.pack(5) + b"\xff\xff\xff\xff\xff")  # not a TokenStreamOpen
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without an answer
        writer.close()
        tokens = await read_all(TokenStreamCall(f"127.0.0.1:{pair.token_stream_port}", local_request("after")))
        assert len(tokens) == PARAMS.max_tokens
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_a_bad_request_ends_with_invalid_argument_in_a_status_frame(tiny_llama_path):
    async def scenario(pair: Pair):
        request = local_request("bad")
        request.sampling_params.top_p = 5.0  # outside (0, 1]
        reader, writer = await asyncio.open_connection("127.0.0.1", pair.token_stream_port)
        writer.write(encode_frame(decode_pb2.TokenStreamOpen(request=request)))
        frame = await asyncio.wait_for(read_frame(reader, decode_pb2.TokenStreamFrame), 5)
        assert frame.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert await read_frame(reader, decode_pb2.TokenStreamFrame) is None  # then the node closes
        writer.close()
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_a_node_that_is_not_there_fails_the_call_unavailable():
    call = TokenStreamCall(dead_address(), local_request("gone"))
    assert asyncio.run(failure_code(call)) == grpc.StatusCode.UNAVAILABLE


def small_socket_pair() -> tuple[socket.socket, socket.socket]:
    ours, peer = socket.socketpair()
    for sock in (ours, peer):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ours.setblocking(False)
    return ours, peer


def test_a_sink_delivers_writes_from_any_thread_in_order_to_a_slow_reader():
    ours, peer = small_socket_pair()
    frames = [bytes([i % 251]) * (100 + i % 900) for i in range(600)]  # ~330 KB, far past the buffers
    received = bytearray()

    def slow_reader():
        while chunk := peer.recv(8192):
            received.extend(chunk)
            time.sleep(0.001)

    async def body():
        sink = FrameSink(asyncio.get_running_loop(), ours.fileno())
        writer = threading.Thread(target=lambda: [sink.write(f) for f in frames[:400]])
        writer.start()  # as the engine thread writes tokens
        await asyncio.to_thread(writer.join)
        for frame in frames[400:]:  # then the loop's own frames, behind the backlog
            sink.write(frame)
        await asyncio.wait_for(sink.drain(), 30)
        sink.close()
        ours.close()

    reader = threading.Thread(target=slow_reader)
    reader.start()
    asyncio.run(body())
    reader.join(30)
    assert bytes(received) == b"".join(frames)


def test_a_sink_drops_writes_once_the_peer_is_gone_or_it_is_closed():
    ours, peer = small_socket_pair()
    peer.close()

    async def body():
        sink = FrameSink(asyncio.get_running_loop(), ours.fileno())
        for _ in range(100):
            sink.write(b"x" * 1000)  # never raises: the hang-up watcher ends the call
        await asyncio.wait_for(sink.drain(), 5)
        sink.close()
        sink.close()
        sink.write(b"after close")

    asyncio.run(body())
    ours.close()


def chunk_frame(i: int) -> bytes:
    return encode_frame(decode_pb2.TokenStreamFrame(response=decode_pb2.GenerateResponse(chunk={"token_ids": [i]})))


OK_FRAME = encode_frame(decode_pb2.TokenStreamFrame(status=decode_pb2.TokenStreamStatus(code=0)))


async def scripted_node_call(send_script) -> TokenStreamCall:
    """A call to a fake node on 127.0.0.1 that reads the open frame, then runs `send_script(writer)`."""

    async def node(reader, writer):
        assert await read_frame(reader, decode_pb2.TokenStreamOpen) is not None
        await send_script(writer)
        writer.close()

    server = await asyncio.start_server(node, "127.0.0.1", 0)
    return server, TokenStreamCall(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", local_request("scripted"))


async def read_tokens(call) -> list[int]:
    tokens = []
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens += message.chunk.token_ids
    return tokens


def run_against_scripted_node(send_script, reader):
    async def body():
        server, call = await scripted_node_call(send_script)
        try:
            return await asyncio.wait_for(reader(call), 30)
        finally:
            call.cancel()
            server.close()

    return asyncio.run(body())


def test_frames_split_anywhere_are_read_whole_and_in_order():
    async def byte_by_byte(writer):
        data = b"".join(chunk_frame(i) for i in range(5)) + OK_FRAME
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            if i % 7 == 0:
                await asyncio.sleep(0)

    assert run_against_scripted_node(byte_by_byte, read_tokens) == [0, 1, 2, 3, 4]


def test_many_unread_frames_pause_the_connection_and_all_arrive():
    num_frames = 3000  # far more than the reader buffers before it pauses

    async def burst(writer):
        writer.write(b"".join(chunk_frame(i) for i in range(num_frames)) + OK_FRAME)
        await writer.drain()

    async def slow_reader(call):
        await asyncio.sleep(0.3)  # every frame is sent before the first read
        return await read_tokens(call)

    assert run_against_scripted_node(burst, slow_reader) == list(range(num_frames))


@pytest.mark.parametrize(
    "tail, reason",
    [
        (b"", "closed before its status"),
        (chunk_frame(9)[:-1], "closed within a frame"),
        (HEADER.pack(1 << 30), "a frame of 1073741824 bytes"),
        (HEADER.pack(3) + b"\xff\xff\xff", "not a TokenStreamFrame"),
    ],
)
def test_a_broken_stream_fails_the_call_unavailable_after_the_good_frames(tail, reason):
    async def then_break(writer):
        writer.write(chunk_frame(1) + chunk_frame(2) + tail)
        await writer.drain()

    async def reader(call):
        tokens = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            while (message := await call.read()) is not grpc.aio.EOF:
                tokens += message.chunk.token_ids
        return tokens, error.value

    tokens, error = run_against_scripted_node(then_break, reader)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and reason in error.details()
    assert tokens == [1, 2]
