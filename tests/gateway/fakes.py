"""Test doubles for the gateway: a scripted FakeBackend and its FakeStream, chunk builders, and an
SSE parser that checks the framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.backend import BackendError, GenerationChunk
from gateway.tokenizer import Tokenizer
from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams

EOS_TOKEN_ID = 2  # <|im_end|> of the default model
DEFAULT_TEXT = "Hello there! 😀 How are you today?"


def text_chunks(
    tokenizer: Tokenizer,
    text: str,
    finish_reason: str = "stop",
    tokens_per_chunk: int = 1,
    with_logprobs: bool = False,
    num_cached_tokens: int = 0,
) -> list[GenerationChunk]:
    """The tokens of `text`, a few per chunk; "stop" ends with an EOS chunk, "length" on the last text chunk."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if finish_reason == "stop":
        token_ids.append(EOS_TOKEN_ID)
    alternative = tokenizer.encode(".", add_special_tokens=False)[0]  # every token's runner-up, for logprobs
    chunks = []
    for start in range(0, len(token_ids), tokens_per_chunk):
        ids = token_ids[start : start + tokens_per_chunk]
        logprobs = [TokenLogprob(t, -0.5, {t: -0.5, alternative: -1.5}) for t in ids] if with_logprobs else []
        chunks.append(GenerationChunk(ids, logprobs, num_cached_tokens=num_cached_tokens))
    chunks[-1].finish_reason = finish_reason
    return chunks


class FakeStream:
    """Scripted chunks as an async iterator that records how it ended. With `hang`, it waits
    forever after the chunks (until the gateway closes it); `error` is raised after `error_after` chunks."""

    def __init__(
        self, chunks: list[GenerationChunk], error: BackendError | None = None, error_after: int = 0, hang: bool = False
    ):
        self.chunks = chunks
        self.error = error
        self.error_after = error_after
        self.hang = hang
        self.num_sent = 0
        self.closed = False

    @property
    def closed_early(self) -> bool:
        """Closed by the gateway before the script ran out (stop string, client gone)."""
        return self.closed and (self.hang or self.num_sent < len(self.chunks))

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        await asyncio.sleep(0)
        if self.closed:
            raise StopAsyncIteration
        if self.error is not None and self.num_sent == self.error_after:
            raise self.error
        if self.num_sent < len(self.chunks):
            self.num_sent += 1
            return self.chunks[self.num_sent - 1]
        if self.hang:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: FakeStream


Script = Callable[[list[int], SamplingParams], list[GenerationChunk]]


@dataclass
class FakeBackend:
    """A GenerationBackend that plays `script` (chunks, or a function of prompt and params) and
    records every call and its stream."""

    script: list[GenerationChunk] | Script
    error: BackendError | None = None
    error_after: int = 0
    hang: bool = False
    ready: bool = True
    num_nodes: dict[str, int] = field(default_factory=lambda: {"colocated": 1})
    calls: list[GenerateCall] = field(default_factory=list)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> FakeStream:
        chunks = self.script(prompt_token_ids, params) if callable(self.script) else self.script
        stream = FakeStream(
            [
                GenerationChunk(list(c.token_ids), list(c.logprobs), c.finish_reason, c.num_cached_tokens)
                for c in chunks
            ],
            self.error,
            self.error_after,
            self.hang,
        )
        self.calls.append(GenerateCall(request_id, list(prompt_token_ids), params, stream))
        return stream

    def is_ready(self) -> bool:
        return self.ready

    def num_nodes_by_role(self) -> dict[str, int]:
        return dict(self.num_nodes) if self.ready else {}


def parse_sse(body: str) -> list[dict | str]:
    """The events of an SSE body, asserting OpenAI's framing: only `data: ...` events, each ended
    by a blank line, the last one `[DONE]`. JSON events are parsed; [DONE] stays a string."""
    assert body.endswith("\n\n"), "events end with a blank line"
    events = body[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events), body
    assert events[-1] == "data: [DONE]"
    return [json.loads(event[6:]) for event in events[:-1]] + ["[DONE]"]
