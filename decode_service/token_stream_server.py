"""The decode node's side of the token stream (protos/token_stream.py): the same
`DecodeServicer.Generate` as the gRPC server runs, served over one plain TCP (or TLS) connection
per call, without grpc-python's per-message CPU.

Lifecycle of one connection:
  1. read the TokenStreamOpen frame (within OPEN_TIMEOUT_S) and check the cluster secret, as the
     gRPC server's interceptor does;
  2. run Generate, writing a frame per message, then the status frame: OK, the code of an abort,
     or UNKNOWN for an unexpected error (logged);
  3. a watcher reads the connection while the call runs: the client closing it (a cancelled call,
     a dead gateway) cancels Generate at once, whose `finally` frees the request's blocks;
  4. close the connection.
On `stop()`, after the node's drain, the listener closes and the calls still open are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
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
    """The part of grpc.aio's ServicerContext that `DecodeServicer.Generate` uses."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise AbortError(code, details)


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
            try:
                await self._generate(opened.request, writer)
            finally:
                hang_up.cancel()
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

    async def _generate(self, request: decode_pb2.GenerateRequest, writer: asyncio.StreamWriter) -> None:
        try:
            async with contextlib.aclosing(self.servicer.Generate(request, TokenStreamContext())) as responses:
                async for response in responses:
                    writer.write(encode_frame(decode_pb2.TokenStreamFrame(response=response)))
                    await writer.drain()  # a slow reader holds the call back, as gRPC's flow control does
            writer.write(encode_frame(status_frame(grpc.StatusCode.OK, "")))
        except AbortError as error:
            writer.write(encode_frame(status_frame(error.code, error.details)))
        except Exception as error:  # the client must learn that the call failed
            logger.exception("token stream: request %s failed", request.request_id)
            writer.write(encode_frame(status_frame(grpc.StatusCode.UNKNOWN, f"decode node error: {error!r}")))


async def _watch_hang_up(reader: asyncio.StreamReader, call: asyncio.Task) -> None:
    """Cancels `call` when the client closes its side (it sends nothing after its open frame)."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(4096):
            pass  # nothing is expected; a client that writes more is ignored
    call.cancel()
