"""A streaming OpenAI-compatible client that timestamps what arrives: one request, one record.

Each request streams (`stream: true`, `stream_options.include_usage`), and every `data:` event is
timed as it is parsed. An event whose choice carries text is a content chunk; the final usage
event gives the exact output and prompt token counts. Anything short of a 200 stream of content
ending in `data: [DONE]` (HTTP error, error event, timeout, dropped connection, no content) is a
failed request with the reason in its record: failures are counted, never dropped.

On a small machine the load generator shares the cores with the server it measures, so each
event should cost it as little CPU as possible: the streamed POST runs on `timed_http`, which
only stores and timestamps the body as it arrives (one callback per packet, the framing parsed by
httptools in C), and the events are parsed once the response has ended. httpx (pure-Python h11)
took 132-210 us of CPU per streamed event and aiohttp 36-110 (2-core Xeon, an event every 8 ms);
on a 2-core Zen 4, events 6 ms apart beside a memory stream, aiohttp took 204-242 us and
`timed_http` 78-106 (uvloop both; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdserve.bench import timed_http
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import Message, completion_prompt

ENDPOINT_TO_PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # the server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"
    timeout_s: float = 300.0  # per request, from send to [DONE]
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None

    def __post_init__(self):
        if self.endpoint not in ENDPOINT_TO_PATH:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose chat or completions")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class _Stream:
    """What one response has delivered so far."""

    content_times_s: list[float]
    text: str = ""
    num_output_tokens: int | None = None
    num_prompt_tokens: int | None = None
    done: bool = False


class StreamingClient:
    """Streams requests, each on a new connection: llama-server closes kept-alive ones on its own
    terms, and a request sent on one it just closed fails. Use as an async context manager (an
    aiohttp session for the model list is opened on entry, on the running event loop)."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self.model = config.model
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamingClient:
        # No proxies from the environment (aiohttp reads none unless trust_env).
        self._http = aiohttp.ClientSession(headers=self._headers, timeout=aiohttp.ClientTimeout(total=60))
        try:
            if self.model is None:
                self.model = await self.first_model()
        except BaseException:
            await self._http.close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._http.close()

    async def first_model(self) -> str:
        async with self._http.get(self.config.root_url + "/v1/models") as response:
            response.raise_for_status()
            models = (await response.json()).get("data") or []
        if not models:
            raise ValueError(f"{self.config.root_url}/v1/models lists no model; pass --model")
        return models[0]["id"]

    def payload(self, messages: Sequence[Message], max_tokens: int) -> dict:
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension, which pdserve and SGLang accept too
        if self.config.endpoint == "completions":
            return body | {"prompt": completion_prompt(messages)}
        if not all(isinstance(message["content"], str) for message in messages):
            raise ValueError("token-id prompts need --endpoint completions")
        return body | {"messages": list(messages)}

    async def send(self, messages: Sequence[Message], max_tokens: int) -> tuple[RequestRecord, str]:
        """One streamed request: its record and the text it generated (a later turn's history)."""
        payload = self.payload(messages, max_tokens)
        stream = _Stream(content_times_s=[])
        start_s = time.perf_counter()
        error = None
        try:
            async with asyncio.timeout(self.config.timeout_s):
                error = await self._receive(payload, stream)
        except TimeoutError:
            error = f"timed out after {self.config.timeout_s:g} s"
        except OSError as exc:  # the connection failed
            error = f"{type(exc).__name__}: {exc}"
        end_s = time.perf_counter()
        if error is None and not stream.done:
            error = "stream ended without data: [DONE]"
        if error is None and not stream.content_times_s:
            error = "no content streamed"
        record = RequestRecord(
            start_s, end_s, tuple(stream.content_times_s), stream.num_output_tokens, stream.num_prompt_tokens, error
        )
        return record, stream.text

    async def _receive(self, payload: dict, stream: _Stream) -> str | None:
        """Reads the SSE stream into `stream`; returns an error message or None. Events are parsed
        after the response ends, each timed by the arrival of its last byte (timed_http.py)."""
        url = self.config.root_url + ENDPOINT_TO_PATH[self.config.endpoint]
        response = await timed_http.post(url, json.dumps(payload).encode(), self._headers)
        if response.status != 200 and response.error is None:
            return f"HTTP {response.status}: {_error_message(response.body.decode(errors='replace'))}"
        for now_s, line in timed_http.timed_lines(response.pieces):
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                stream.done = True
                return None
            try:
                event = json.loads(data)
            except ValueError:
                return f"malformed event: {data[:200].decode(errors='replace')}"
            error = _take_event(event, now_s, stream)
            if error is not None:
                return error
        return response.error


def _take_event(event: dict, now_s: float, stream: _Stream) -> str | None:
    if "error" in event:
        return f"error event: {_error_message(json.dumps(event))}"
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            stream.content_times_s.append(now_s)
            stream.text += text
    usage = event.get("usage")
    if usage:
        stream.num_output_tokens = usage.get("completion_tokens")
        stream.num_prompt_tokens = usage.get("prompt_tokens")
    return None


def _error_message(body: str) -> str:
    """The OpenAI error object's message, else the start of the body."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return body[:200]
