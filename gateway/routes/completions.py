"""POST /v1/completions: plain prompts (text or token ids), streamed or not."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request, Response

from gateway.dependencies import BackendDep, RequestIdDep, ServedModelDep
from gateway.errors import RequestError
from gateway.generation import ChoiceStream
from gateway.limits import RequestLimitsDep, check_request_limits
from gateway.logprobs import completion_logprobs
from gateway.protocol import CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse
from gateway.responses import SSEResponse, TextEvents, run_unless_disconnected, sse_event
from gateway.routes.common import check_model, collect_choices, end_with_done, streamed_responses
from gateway.sampling import choice_specs
from gateway.tokenizer import Tokenizer
from gateway.usage import UsageCounter

router = APIRouter(tags=["completions"])

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@router.post("/v1/completions", response_model=CompletionResponse, responses=streamed_responses(CompletionChunk))
async def create_completion(
    body: CompletionRequest,
    request: Request,
    response: Response,
    backend: BackendDep,
    served_model: ServedModelDep,
    request_id: RequestIdDep,
    limits: RequestLimitsDep,
):
    check_model(served_model, body.model)
    tokenizer = served_model.tokenizer
    check_request_limits(
        body,
        limits,
        vocab_size=tokenizer.vocab_size,
        num_prompts=count_prompts(body.prompt),
        requested_max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        logprobs_param="logprobs",
    )
    # A long prompt takes a while to tokenize: not on the event loop, which serves every other request.
    prompts = await anyio.to_thread.run_sync(tokenize_prompts, tokenizer, body.prompt)
    response_id = f"cmpl-{request_id}"
    specs = choice_specs(
        body,
        response_id,
        prompts,
        requested_max_tokens=body.max_tokens,
        default_max_tokens=min(DEFAULT_MAX_TOKENS, limits.max_output_tokens or DEFAULT_MAX_TOKENS),
        max_model_len=served_model.max_model_len,
        logprobs=body.logprobs,
        prompt_param="prompt",
    )
    usage = UsageCounter([len(p) for p in prompts], body.n)
    stream = await run_unless_disconnected(request, ChoiceStream.open(backend, tokenizer, specs))
    header = {"id": response_id, "created": int(time.time()), "model": served_model.name}
    if body.stream:
        events = _completion_events(stream, header, tokenizer, usage, body.include_usage, body.logprobs is not None)
        return SSEResponse(end_with_done(events), on_close=stream.aclose, headers=stream.route_headers())
    results = await collect_choices(request, stream, len(specs), usage)
    choices = [
        CompletionChoice(
            index=index,
            text=result.text,
            logprobs=completion_logprobs(tokenizer, result.logprobs, 0) if body.logprobs is not None else None,
            finish_reason=result.finish_reason,
        )
        for index, result in enumerate(results)
    ]
    response.headers.update(stream.route_headers())
    return CompletionResponse(**header, choices=choices, usage=usage.usage())


def count_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """A string or one token id list is one prompt; otherwise each list entry is one."""
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def tokenize_prompts(tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Every accepted prompt form as token id lists, checked against the vocabulary."""
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    for token_ids in prompts:
        if not token_ids:
            raise RequestError("the prompt is empty after tokenization", param="prompt")
        if any(not 0 <= t < tokenizer.vocab_size for t in token_ids):
            raise RequestError(f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
    return prompts


async def _completion_events(
    stream: ChoiceStream,
    header: dict,
    tokenizer: Tokenizer,
    usage: UsageCounter,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    """Text chunks per choice, then a chunk with the choice's finish reason, then the usage."""
    text_offsets: dict[int, int] = defaultdict(int)
    text_events = TextEvents(
        lambda index, text: CompletionChunk(**header, choices=[CompletionChoice(index=index, text=text)])
    )
    async for delta in stream:
        usage.add(delta)
        if want_logprobs and (delta.text or delta.logprobs):
            logprobs = completion_logprobs(tokenizer, delta.logprobs, text_offsets[delta.index])
            text_offsets[delta.index] += sum(len(token) for token in logprobs.tokens)
            choice = CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs)
            yield sse_event(CompletionChunk(**header, choices=[choice]))
        elif delta.text:
            yield text_events.event(delta.index, delta.text)
        if delta.finish_reason is not None:
            choice = CompletionChoice(index=delta.index, text="", finish_reason=delta.finish_reason)
            yield sse_event(CompletionChunk(**header, choices=[choice]))
    if include_usage:
        yield sse_event(CompletionChunk(**header, choices=[], usage=usage.usage()))
