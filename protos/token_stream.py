"""The token stream: a decode node's Generate over one plain TCP (or TLS) connection per call. The
gateway uses it instead of the gRPC stream for nodes that advertise one (`NodeInfo.token_stream_address`).

Why not gRPC for this one call: grpc-python spends about 160 us of the client's CPU and 220 us of
the server's on each streamed message (its completion queue hands every message between threads),
while a length-prefixed frame on an asyncio stream costs about 20 and 50 (docs/benchmarks.md,
eleventh pass). At one message per token on a 2-core machine, that CPU is taken from the engine's
threads.

One call, one connection:
    client -> node   one TokenStreamOpen frame: the cluster secret as gRPC's metadata carries it,
                     and the GenerateRequest
    node -> client   a TokenStreamFrame per GenerateResponse, the messages and order of the gRPC
                     stream, then a TokenStreamStatus frame (OK, or the gRPC status code and
                     details of a failed call), as gRPC's trailers; then the node closes the
                     connection. A connection that closes before the status frame is a failed
                     call (UNAVAILABLE): the node died, stopped, or refused the handshake
    cancel           the client closes the connection: the node sees it at once and aborts the
                     request, as for a cancelled gRPC call
A frame is a 4-byte big-endian length, then the serialized message. `TokenStreamCall` reads like
grpc.aio's stream call and raises `grpc.aio.AioRpcError` as it would, so its callers (the gateway's
failover, the tests) handle both transports alike.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections import deque
from collections.abc import Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from protos import decode_pb2

HEADER = struct.Struct(">I")
# Far above any frame: a GenerateRequest of a 128k-token prompt is ~640 KB.
MAX_FRAME_BYTES = 64 << 20
# A node whose host is gone answers no SYN: fail over after this, as the gRPC channels do.
CONNECT_TIMEOUT_S = 2.0

_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

M = TypeVar("M", bound=Message)


class FrameError(Exception):
    """The peer sent something that is not a frame of the token stream."""


def encode_frame(message: Message) -> bytes:
    payload = message.SerializeToString()
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, message_type: type[M]) -> M | None:
    """The next frame's message; None when the peer closed the connection between frames.
    Raises asyncio.IncompleteReadError when it closed within one, FrameError on garbage."""
    header = await reader.read(HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        header += await reader.readexactly(HEADER.size - len(header))
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    message = message_type()
    try:
        message.ParseFromString(await reader.readexactly(size))
    except DecodeError as error:
        raise FrameError(f"not a {message_type.__name__}: {error}") from error
    return message


def status_frame(code: grpc.StatusCode, details: str) -> decode_pb2.TokenStreamFrame:
    return decode_pb2.TokenStreamFrame(status=decode_pb2.TokenStreamStatus(code=code.value[0], details=details))


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What grpc.aio raises for a failed call, so that callers of either transport catch one kind."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _FrameReader(asyncio.Protocol):
    """The client's end of a call: splits the node's frames as their bytes arrive, so that reading
    a frame that is already in is a deque pop. One token's frame used to pass through a
    StreamReader and three coroutines (`read_frame`); at one frame per token, with the caches
    cold after each decode step, every Python call the gateway saves per token counts."""

    # Reading pauses while this many frames wait unread (a client slower than the node).
    MAX_UNREAD_FRAMES = 256

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._frames: deque[decode_pb2.TokenStreamFrame] = deque()
        self._waiter: asyncio.Future | None = None
        self._ended: BaseException | None = None  # why no frame will follow the buffered ones
        self._closed_cleanly = False  # the node closed the connection between frames
        self._transport: asyncio.Transport | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME_BYTES:
                self._end(FrameError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})"))
                return
            end = start + HEADER.size + size
            if len(buffer) < end:
                break
            frame = decode_pb2.TokenStreamFrame()
            try:
                frame.ParseFromString(bytes(buffer[start + HEADER.size : end]))
            except DecodeError as error:
                self._end(FrameError(f"not a TokenStreamFrame: {error}"))
                return
            self._frames.append(frame)
            start = end
        del buffer[:start]
        if len(self._frames) >= self.MAX_UNREAD_FRAMES and not self._paused:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        if self._buffer:
            self._end(EOFError(f"the connection closed within a frame ({len(self._buffer)} bytes of it)"))
        else:
            self._closed_cleanly = True
            self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._end(exc)
        elif not self._closed_cleanly:
            self.eof_received()

    async def read(self) -> decode_pb2.TokenStreamFrame | None:
        """The next frame; None once the node closed the connection between frames. Raises
        OSError, EOFError or FrameError for a broken connection."""
        while not self._frames:
            if self._ended is not None:
                raise self._ended
            if self._closed_cleanly:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._paused and len(self._frames) < self.MAX_UNREAD_FRAMES // 2:
            self._paused = False
            self._transport.resume_reading()
        return self._frames.popleft()

    def _end(self, error: BaseException) -> None:
        if self._ended is None:
            self._ended = error  # raised once the whole frames before the break have been read
            if self._transport is not None:
                self._transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class TokenStreamCall:
    """One Generate call on a node's token stream, read like grpc.aio's unary-stream call: `read()`
    returns the next GenerateResponse, then grpc.aio.EOF, and raises grpc.aio.AioRpcError for a
    failed call (UNAVAILABLE when the connection fails); `cancel()` ends the call. It connects on
    the first `read()`."""

    def __init__(
        self,
        address: str,
        request: decode_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str]] = (),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.address = address
        self._open = decode_pb2.TokenStreamOpen(authorization=dict(metadata).get("authorization", ""), request=request)
        self._ssl_context = ssl_context
        self._transport: asyncio.Transport | None = None
        self._frames: _FrameReader | None = None
        self._done = False

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        try:
            if self._frames is None:
                await self._connect()
            frame = await self._frames.read()
        except (OSError, EOFError, TimeoutError, FrameError) as error:  # ssl.SSLError is an OSError
            self.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"token stream to {self.address}: {error!r}") from error
        if frame is None:
            self.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"token stream to {self.address}: closed before its status")
        if frame.HasField("status"):
            self.cancel()
            code = _CODE_BY_NUMBER.get(frame.status.code, grpc.StatusCode.UNKNOWN)
            if code == grpc.StatusCode.OK:
                return grpc.aio.EOF
            raise rpc_error(code, frame.status.details)
        return frame.response

    async def _connect(self) -> None:
        host, port = split_address(self.address)
        tls = {"ssl": self._ssl_context, "server_hostname": host} if self._ssl_context else {}
        connecting = asyncio.get_running_loop().create_connection(_FrameReader, host, port, **tls)
        self._transport, frames = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        if self._done:  # cancelled while connecting
            self._transport.close()
            raise EOFError("the call was cancelled")
        self._frames = frames
        self._transport.write(encode_frame(self._open))

    def cancel(self) -> bool:
        """Closes the connection (the node aborts the request if it has not finished); a no-op
        after the end. True if it ended the call."""
        if self._done:
            return False
        self._done = True
        if self._transport is not None:
            self._transport.close()
        return True
