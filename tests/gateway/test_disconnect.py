"""A client that goes away must not leave generations running: the gateway closes the backend
stream (the nodes abort the request). Driven at the ASGI level to control the disconnect exactly."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.backend import GenerationChunk

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


async def call_then_disconnect(app, body: dict, spec_version: str) -> list[dict]:
    """POSTs `body` to the chat route. Under ASGI 2.3 the client reports a disconnect once the
    first event arrived (or at once for a JSON request); under 2.4 sending the second event fails."""
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    got_event = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if request:
            return request.pop()
        if spec_version == "2.4" or body.get("stream"):
            await got_event.wait()
            if spec_version == "2.4":
                await asyncio.Event().wait()  # 2.4 servers report a disconnect by failing send()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            if spec_version == "2.4" and got_event.is_set():
                raise OSError("connection reset")
            got_event.set()
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_streaming_client_disconnect_closes_the_backend_stream(app, backend, spec_version):
    backend.hang = True  # the backend never finishes on its own
    sent = asyncio.run(call_then_disconnect(app, {**CHAT, "stream": True}, spec_version))
    assert sent[0]["status"] == 200
    assert backend.calls[0].stream.closed_early


def test_non_streamed_client_disconnect_closes_the_backend_stream(app, backend):
    backend.hang = True
    asyncio.run(call_then_disconnect(app, CHAT, "2.3"))
    assert backend.calls[0].stream.closed_early


def test_disconnect_cancels_every_choice(app, backend):
    backend.hang = True
    asyncio.run(call_then_disconnect(app, {**CHAT, "stream": True, "n": 3}, "2.3"))
    assert len(backend.calls) == 3
    assert all(call.stream.closed_early for call in backend.calls)


class AsyncGeneratorBackend:
    """Shaped like the real backends: `generate` is an async generator; records how it ended."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.ended: str | None = None

    async def generate(self, request_id, prompt_token_ids, params):
        try:
            for token_id in self.token_ids:
                yield GenerationChunk([token_id])
            await asyncio.Event().wait()
            self.ended = "finished"
        except (GeneratorExit, asyncio.CancelledError):
            self.ended = "aborted"
            raise

    def is_ready(self) -> bool:
        return True


def test_async_generator_backend_is_aborted_on_disconnect(settings, served_model, monkeypatch, tokenizer):
    from gateway import app as gateway_app

    monkeypatch.setattr(gateway_app, "load_served_model", lambda _settings: served_model)
    backend = AsyncGeneratorBackend(tokenizer.encode("Hello", add_special_tokens=False))
    app = gateway_app.create_app(settings, backend)
    asyncio.run(call_then_disconnect(app, {**CHAT, "stream": True}, "2.3"))
    assert backend.ended == "aborted"
