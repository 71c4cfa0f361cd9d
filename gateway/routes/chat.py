"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request, Response

from gateway.dependencies import BackendDep, RequestIdDep, ServedModelDep
from gateway.errors import RequestError
from gateway.generation import ChoiceStream
from gateway.limits import RequestLimitsDep, check_request_limits
from gateway.logprobs import chat_logprobs
from gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
)
from gateway.responses import SSEResponse, TextEvents, run_unless_disconnected, sse_event
from gateway.routes.common import check_model, collect_choices, end_with_done, streamed_responses
from gateway.sampling import choice_specs
from gateway.tokenizer import Tokenizer
from gateway.usage import UsageCounter

router = APIRouter(tags=["chat"])


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=streamed_responses(ChatCompletionChunk)
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    response: Response,
    backend: BackendDep,
    served_model: ServedModelDep,
    request_id: RequestIdDep,
    limits: RequestLimitsDep,
):
    check_model(served_model, body.model)
    tokenizer = served_model.tokenizer
    requested_max_tokens = body.max_completion_tokens or body.max_tokens
    check_request_limits(
        body,
        limits,
        vocab_size=tokenizer.vocab_size,
        num_prompts=1,
        requested_max_tokens=requested_max_tokens,
        logprobs=body.top_logprobs if body.logprobs else None,
        logprobs_param="top_logprobs",
    )
    # A long conversation takes a while to render and tokenize: not on the event loop.
    prompt_token_ids = await anyio.to_thread.run_sync(tokenize_messages, tokenizer, body)
    response_id = f"chatcmpl-{request_id}"
    specs = choice_specs(
        body,
        response_id,
        [prompt_token_ids],
        requested_max_tokens=requested_max_tokens,
        default_max_tokens=limits.max_output_tokens,  # None: up to the end of the context, as OpenAI does
        max_model_len=served_model.max_model_len,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_param="messages",
    )
    usage = UsageCounter([len(prompt_token_ids)], body.n)
    stream = await run_unless_disconnected(request, ChoiceStream.open(backend, tokenizer, specs))
    header = {"id": response_id, "created": int(time.time()), "model": served_model.name}
    if body.stream:
        events = _chat_events(stream, header, tokenizer, usage, body.n, body.include_usage, bool(body.logprobs))
        return SSEResponse(end_with_done(events), on_close=stream.aclose, headers=stream.route_headers())
    results = await collect_choices(request, stream, len(specs), usage)
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=result.text),
            logprobs=chat_logprobs(tokenizer, result.logprobs) if body.logprobs else None,
            finish_reason=result.finish_reason,
        )
        for index, result in enumerate(results)
    ]
    response.headers.update(stream.route_headers())
    return ChatCompletionResponse(**header, choices=choices, usage=usage.usage())


def tokenize_messages(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages = [message.to_template_dict() for message in body.messages]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from exc
    # The template already wrote the special tokens (BOS and friends), as transformers encodes it.
    return tokenizer.encode(prompt, add_special_tokens=False)


async def _chat_events(
    stream: ChoiceStream,
    header: dict,
    tokenizer: Tokenizer,
    usage: UsageCounter,
    num_choices: int,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    """A role chunk per choice, content chunks, a chunk with each choice's finish reason, the usage."""
    for index in range(num_choices):
        choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        yield sse_event(ChatCompletionChunk(**header, choices=[choice]))
    text_events = TextEvents(
        lambda index, text: ChatCompletionChunk(
            **header, choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text))]
        )
    )
    async for delta in stream:
        usage.add(delta)
        if want_logprobs and (delta.text or delta.logprobs):
            logprobs = chat_logprobs(tokenizer, delta.logprobs)
            choice = ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text), logprobs=logprobs)
            yield sse_event(ChatCompletionChunk(**header, choices=[choice]))
        elif delta.text:
            yield text_events.event(delta.index, delta.text)
        if delta.finish_reason is not None:
            choice = ChatChunkChoice(index=delta.index, delta=ChatDelta(), finish_reason=delta.finish_reason)
            yield sse_event(ChatCompletionChunk(**header, choices=[choice]))
    if include_usage:
        yield sse_event(ChatCompletionChunk(**header, choices=[], usage=usage.usage()))
