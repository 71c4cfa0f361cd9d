"""The decode node's side of the token stream (protos/token_stream.py): the same
`DecodeServicer.Generate` as the gRPC server runs, served over one plain TCP (or TLS) connection
per call, without grpc-python's per-message CPU.

Lifecycle of one connection:
  1. read the TokenStreamOpen frame (within OPEN_TIMEOUT_S) and check the cluster secret, as the
     gRPC server's interceptor does;
  2. run Generate, writing a frame per message, then the status frame: OK, the code of an abort,
     or UNKNOWN for an unexpected error (logged); on a plain TCP connection every frame goes
     through a `FrameSink`, which the engine thread writes the token chunks to directly (the
     event loop's thread then does nothing per token); over TLS the loop writes them all;
  3. a watcher reads the connection while the call runs: the client closing it (a cancelled call,
     a dead gateway) cancels Generate at once, whose `finally` frees the request's blocks;
  4. close the connection.
On `stop()`, after the node's drain, the listener closes and the calls still open are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import threading
from typing import NoReturn

import grpc

from decode_service.servicer import DecodeServicer
from pdserve.cluster_state.secret import AUTHORIZATION, bearer_matches
from protos import decode_pb2
from protos.token_stream import FrameError, encode_frame, read_frame, status_frame

logger = logging.getLogger(__name__)

# A client sends its only frame at once: a connection that does not is closed.
OPEN_TIMEOUT_S = 10.0


class AbortError(Exception):
    """What `TokenStreamContext.abort` raises: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class TokenStreamContext:
    """The part of grpc.aio's ServicerContext that `DecodeServicer.Generate` uses, and, with a
    sink, `write_response`: a thread-safe way to send a message that Generate hands the engine
    thread."""

    def __init__(self, sink: FrameSink | None = None) -> None:
        if sink is not None:
            self.write_response = lambda response: sink.write(response_frame(response))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise AbortError(code, details)


def response_frame(response: decode_pb2.GenerateResponse) -> bytes:
    return encode_frame(decode_pb2.TokenStreamFrame(response=response))


class FrameSink:
    """All writes to one plain TCP connection, in order, from any thread, never blocking: a write
    goes to the socket at once (through a duplicate of its descriptor, non-blocking), and what the
    socket does not take waits in a backlog that the event loop sends as the socket drains, with
    every later write behind it. A slow reader grows the backlog by what its request generates
    (bounded by max_tokens), as the queue of outputs grew behind stalled writes before. Once the
    peer is gone, or after `close`, writes are dropped (the hang-up watcher cancels the call)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._loop = loop
        self._fd = os.dup(fd)  # its own number: the loop may watch it while the transport owns fd
        self._lock = threading.Lock()
        self._backlog = bytearray()
        self._watching = False  # the loop waits for the socket to take the backlog
        self._dropping = False  # the peer is gone, or close() ran
        self._closed = False
        self._drained = asyncio.Event()  # touched on the loop only

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._dropping:
                return
            if not self._backlog:
                data = data[self._send(data) :]
            if data:
                self._backlog += data
                self._loop.call_soon_threadsafe(self._watch)

    async def drain(self) -> None:
        """Returns once the backlog is sent, or dropped."""
        while True:
            with self._lock:
                if not self._backlog:
                    return
                self._drained.clear()
            self._watch()
            await self._drained.wait()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = self._dropping = True
            self._backlog.clear()
            if self._watching:
                self._loop.remove_writer(self._fd)
            os.close(self._fd)
        self._drained.set()

    def _send(self, data: bytes | bytearray) -> int:
        """The bytes the socket took: all of them once the peer is gone (they are dropped)."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # reset or closed by the peer: nothing more can reach it
            self._dropping = True
            return len(data)

    def _watch(self) -> None:  # on the loop
        with self._lock:
            if self._backlog and not self._dropping and not self._watching:
                self._watching = True
                self._loop.add_writer(self._fd, self._flush)

    def _flush(self) -> None:  # on the loop, when the socket can take more
        with self._lock:
            if self._closed:
                return
            if not self._dropping:
                del self._backlog[: self._send(self._backlog)]
                if self._backlog:
                    return
            self._backlog.clear()
            self._watching = False
            self._loop.remove_writer(self._fd)
        self._drained.set()


class TokenStreamServer:
    """Serves `servicer.Generate` on a TCP port; with a secret, a call must carry it, and with an
    ssl_context the port speaks TLS only."""

    def __init__(
        self, servicer: DecodeServicer, secret: str | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.servicer = servicer
        self._secret = secret
        self._ssl_context = ssl_context
        self._server: asyncio.Server | None = None
        self._calls: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port) and returns the port."""
        self._server = await asyncio.start_server(self._serve_connection, host, port, ssl=self._ssl_context)
        return self._server.sockets[0].getsockname()[1]

    @property
    def num_open_calls(self) -> int:
        return len(self._calls)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stops listening; the calls still open after `grace_s` are cancelled (the gateway resumes
        them elsewhere)."""
        if self._server is None:
            return
        self._server.close()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=grace_s)
        for call in set(self._calls):
            call.cancel()
        if self._calls:
            await asyncio.wait(set(self._calls))
        await self._server.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            opened = await self._read_open(reader)
            if opened is None:
                return
            if self._secret is not None and not bearer_matches([(AUTHORIZATION, opened.authorization)], self._secret):
                writer.write(
                    encode_frame(status_frame(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret"))
                )
                return
            hang_up = asyncio.create_task(_watch_hang_up(reader, task))
            sink = (
                None
                if self._ssl_context
                else FrameSink(asyncio.get_running_loop(), writer.get_extra_info("socket").fileno())
            )
            try:
                await self._generate(opened.request, sink or writer, TokenStreamContext(sink))
            finally:
                hang_up.cancel()
                if sink is not None:
                    sink.close()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client went away (or the node stops): Generate's `finally` has released the request
        finally:
            self._calls.discard(task)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()

    async def _read_open(self, reader: asyncio.StreamReader) -> decode_pb2.TokenStreamOpen | None:
        try:
            return await asyncio.wait_for(read_frame(reader, decode_pb2.TokenStreamOpen), OPEN_TIMEOUT_S)
        except (TimeoutError, FrameError, asyncio.IncompleteReadError, OSError) as error:
            logger.warning("token stream: closing a connection that sent no call: %r", error)
            return None

    async def _generate(
        self, request: decode_pb2.GenerateRequest, out: FrameSink | asyncio.StreamWriter, context: TokenStreamContext
    ) -> None:
        """Runs the call, writing its frames to `out` (the connection's sink, or its writer over TLS)."""
        try:
            async with contextlib.aclosing(self.servicer.Generate(request, context)) as responses:
                async for response in responses:
                    out.write(response_frame(response))
                    await out.drain()  # a slow reader holds this loop back, as gRPC's flow control does
            out.write(encode_frame(status_frame(grpc.StatusCode.OK, "")))
        except AbortError as error:
            out.write(encode_frame(status_frame(error.code, error.details)))
        except Exception as error:  # the client must learn that the call failed
            logger.exception("token stream: request %s failed", request.request_id)
            out.write(encode_frame(status_frame(grpc.StatusCode.UNKNOWN, f"decode node error: {error!r}")))
        await out.drain()  # the status frame is out before the connection closes


async def _watch_hang_up(reader: asyncio.StreamReader, call: asyncio.Task) -> None:
    """Cancels `call` when the client closes its side (it sends nothing after its open frame)."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(4096):
            pass  # nothing is expected; a client that writes more is ignored
    call.cancel()
