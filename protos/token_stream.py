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
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._done = False

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        try:
            if self._reader is None:
                await self._connect()
            frame = await read_frame(self._reader, decode_pb2.TokenStreamFrame)
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
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, **tls), CONNECT_TIMEOUT_S
        )
        self._writer.write(encode_frame(self._open))

    def cancel(self) -> bool:
        """Closes the connection (the node aborts the request if it has not finished); a no-op
        after the end. True if it ended the call."""
        if self._done:
            return False
        self._done = True
        if self._writer is not None:
            self._writer.close()
        return True
