"""HTTP plumbing for generations: the SSE response, its event encoding, and cancelling a
non-streamed generation when its client goes away (so the nodes abort it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring  # the C encoder of a str as a JSON string
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import CLIENT_CLOSED_REQUEST, RequestError, to_openai_error

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> bytes:
    """`data: {json}\\n\\n`; a chunk without usage leaves the field out, as OpenAI does."""
    exclude = {"usage"} if getattr(payload, "usage", True) is None else None
    return b"data: " + payload.model_dump_json(exclude=exclude).encode() + b"\n\n"


class TextEvents:
    """The SSE events of chunks that carry only new text, for one response: pydantic serializes the
    chunk once per choice with a placeholder for the text, and each event splices the text in,
    escaped as pydantic escapes it. A streamed token then builds and validates no model: with the
    caches cold (a decode step's weights pass through them between two tokens), the models cost
    ~80 us of the gateway's CPU per message (docs/benchmarks.md)."""

    _PLACEHOLDER = "\x00text\x00"

    def __init__(self, make_chunk: Callable[[int, str], BaseModel]) -> None:
        self._make_chunk = make_chunk  # (choice index, text) -> the chunk model
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def event(self, index: int, text: str) -> bytes:
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._template(index)
        head, tail = template
        return head + encode_basestring(text).encode() + tail

    def _template(self, index: int) -> tuple[bytes, bytes]:
        event = sse_event(self._make_chunk(index, self._PLACEHOLDER))
        marker = encode_basestring(self._PLACEHOLDER).encode()
        if event.count(marker) != 1:
            raise ValueError(f"the chunk must hold its text exactly once: {event!r}")
        head, _, tail = event.partition(marker)
        return head, tail


def sse_error(exc: Exception) -> bytes:
    """An error after the 200 went out: the OpenAI error object as one more event."""
    _, body = to_openai_error(exc)
    return sse_event(body)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: finished, client gone
    (even before the first byte), or failed, so that no backend stream outlives its client."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # ASGI 2.4 servers report a gone client by failing send(): nobody is left to tell
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_close()


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (then raises a 499 RequestError,
    whose response goes nowhere)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise RequestError("the client closed the connection", status_code=CLIENT_CLOSED_REQUEST)
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
