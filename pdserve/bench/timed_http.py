"""One HTTP/1.1 POST whose response body is kept as it arrives, each piece with its arrival time.

The benchmark's load generator shares the cores of the server it measures (2 of them, in CI and
on the machines docs/benchmarks.md was measured on). Read through aiohttp, each streamed event
took the client 204-242 us of CPU when events came 6 ms apart (a decode step) beside a memory
stream (2-core Zen 4, uvloop): every event ran aiohttp's stream reader, a line iterator,
`json.loads` and the record keeping with caches the server's weight stream had just evicted,
and that CPU came out of the server's decode steps. Here an event costs one `data_received`
call, 78-106 us: httptools (the C parser uvicorn uses) splits the framing, the body pieces are
stored with `time.perf_counter()`, and the caller parses the events after the response has
ended (`timed_lines`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools


@dataclass
class TimedResponse:
    status: int | None = None  # None until the status line arrived
    pieces: list[tuple[float, bytes]] = field(default_factory=list)  # (perf_counter s, body bytes)
    error: str | None = None  # why the response did not end properly (then it may be partial)

    @property
    def body(self) -> bytes:
        return b"".join(piece for _, piece in self.pieces)


class _ResponseReader(asyncio.Protocol):
    """Feeds httptools; `finished` resolves once the message ends or the connection does."""

    def __init__(self, response: TimedResponse, finished: asyncio.Future) -> None:
        self._response = response
        self._finished = finished
        self._parser = httptools.HttpResponseParser(self)
        self._now_s = 0.0

    # asyncio.Protocol

    def data_received(self, data: bytes) -> None:
        self._now_s = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"malformed HTTP response: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._finish(f"the server closed the connection before the response ended{reason}")

    # httptools callbacks

    def on_headers_complete(self) -> None:
        self._response.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._response.pieces.append((self._now_s, body))

    def on_message_complete(self) -> None:
        self._finish(None)

    def _finish(self, error: str | None) -> None:
        if not self._finished.done():
            self._response.error = error
            self._finished.set_result(None)


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> TimedResponse:
    """POSTs `body` on a new connection (closed after the response) and waits for the whole
    response. Connection failures raise OSError; a response that breaks off comes back with its
    `error` set and what arrived before. Cancelling (a timeout) closes the connection."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url}")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    loop = asyncio.get_running_loop()
    response = TimedResponse()
    finished = loop.create_future()
    transport, _ = await loop.create_connection(
        lambda: _ResponseReader(response, finished),
        parts.hostname,
        port,
        ssl=ssl.create_default_context() if https else None,
    )
    try:
        transport.write(_request_head(parts.netloc, parts.path or "/", len(body), headers or {}) + body)
        await finished
    finally:
        transport.close()
    return response


def _request_head(host: str, path: str, content_length: int, headers: dict[str, str]) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {content_length}",
        "Accept: text/event-stream",
        # A new connection per request: llama-server closes kept-alive ones on its own terms.
        "Connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def timed_lines(pieces: list[tuple[float, bytes]]) -> Iterator[tuple[float, bytes]]:
    """The body's lines (without line endings), each with the arrival time of its last byte."""
    partial = b""
    time_s = 0.0
    for time_s, piece in pieces:
        *lines, partial = (partial + piece).split(b"\n")
        for line in lines:
            yield time_s, line.removesuffix(b"\r")
    if partial:
        yield time_s, partial.removesuffix(b"\r")
