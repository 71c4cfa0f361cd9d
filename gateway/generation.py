"""Turns a response's choices into backend generations and their token chunks into text deltas.

Lifecycle of one response:
  1. `ChoiceStream.open` starts one backend generation per choice (n per prompt), concurrently
     (a task each, when there are several), and waits for the first delta, so that an error
     before any output (overloaded, no node) becomes an HTTP error instead of a broken stream.
  2. Each choice detokenizes its chunks and applies stop strings; a stop string hit closes that
     choice's backend stream at once (the nodes abort it).
  3. The deltas of all choices arrive merged, in the order they are produced.
  4. `aclose()` (done, client gone, error) ends what is still running and closes every
     backend stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from gateway.backend import BackendError, BackendErrorKind, GenerationBackend
from gateway.detokenizer import Detokenizer
from gateway.tokenizer import Tokenizer
from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChoiceSpec:
    """One backend generation: one choice of the response."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()


@dataclass
class ChoiceDelta:
    """New final text of one choice, with the logprobs of the tokens it came from."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0  # tokens the backend produced since the last delta
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    route: str | None = None  # set when the backend reports nodes: first delta, and after a failover


async def close_quietly(stream: object) -> None:
    """Closes an async iterator even while the caller is being cancelled (client gone)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def stream_choice(
    backend: GenerationBackend, tokenizer: Tokenizer, spec: ChoiceSpec
) -> AsyncIterator[ChoiceDelta]:
    """The deltas of one choice; the last one has the finish reason. Only non-empty text or the
    finish makes a delta: logprobs of held-back tokens wait for the text they belong to."""
    detokenizer = Detokenizer(tokenizer, spec.stop)
    pending = ChoiceDelta(spec.index, "")
    stream = backend.generate(spec.request_id, spec.prompt_token_ids, spec.params)
    try:
        async for chunk in stream:
            # A chunk of several tokens (a node's --stream-interval) may run past a stop string.
            text, num_used = detokenizer.add_tokens_until_stop(chunk.token_ids)
            pending.text += text
            pending.logprobs += chunk.logprobs[:num_used]
            pending.num_tokens += num_used
            pending.num_cached_tokens = max(pending.num_cached_tokens, chunk.num_cached_tokens)
            pending.route = chunk.route or pending.route
            if chunk.finish_reason is not None:
                pending.text += detokenizer.finish()
            if detokenizer.stopped or chunk.finish_reason is not None:
                pending.finish_reason = "stop" if detokenizer.stopped else chunk.finish_reason
                yield pending
                return  # the finally closes the backend stream: a stop string aborts the request
            if pending.text:
                yield pending
                pending = ChoiceDelta(spec.index, "", num_cached_tokens=pending.num_cached_tokens)
        raise BackendError(
            BackendErrorKind.UNAVAILABLE, f"request {spec.request_id}: the stream ended without a finish reason"
        )
    finally:
        await close_quietly(stream)


_DONE = object()


async def merge_choices(choices: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """The deltas of several choices in the order they are produced, one task each; raises the
    first error. Closing it cancels the choices still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(deltas: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in deltas:
                queue.put_nowait(delta)
            queue.put_nowait(_DONE)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(deltas)) for deltas in choices]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is _DONE:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # each choice's backend stream closes on the way out
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class ChoiceStream:
    """The merged deltas of all choices of a response. Construct with `open`; always `aclose`."""

    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer, specs: list[ChoiceSpec]) -> None:
        choices = [stream_choice(backend, tokenizer, spec) for spec in specs]
        # One choice, the common case, is read in the consumer's own task: a task per choice
        # and the queue between them cost every token two more task switches.
        self._deltas = choices[0] if len(choices) == 1 else merge_choices(choices)
        self._first: ChoiceDelta | None = None
        self.routes: dict[int, str] = {}  # choice index -> its latest route (a failover moves it)

    def route_headers(self) -> dict[str, str]:
        """`x-pdserve-route`: each choice's nodes and cached tokens, for the choices started so far
        (a streamed response sends it with the first delta; a whole one, with the final nodes)."""
        if not self.routes:
            return {}
        return {"x-pdserve-route": ", ".join(self.routes[index] for index in sorted(self.routes))}

    @classmethod
    async def open(cls, backend: GenerationBackend, tokenizer: Tokenizer, specs: list[ChoiceSpec]) -> ChoiceStream:
        """Starts every choice and waits for the first delta; raises what the backend raised first."""
        self = cls(backend, tokenizer, specs)
        try:
            self._first = await self._next_delta()
        except BaseException:
            await self.aclose()
            raise
        return self

    def __aiter__(self) -> ChoiceStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._next_delta()

    async def _next_delta(self) -> ChoiceDelta:
        delta = await anext(self._deltas)
        if delta.route is not None:
            self.routes[delta.index] = delta.route
        return delta

    async def aclose(self) -> None:
        """Ends unfinished choices; each one's backend stream closes on the way out."""
        await close_quietly(self._deltas)
