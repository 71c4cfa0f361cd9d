"""What the completion and chat handlers share: the model check, collecting a non-streamed
response, and the OpenAPI description of streamed and error responses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from gateway.errors import RequestError
from gateway.generation import ChoiceStream
from gateway.protocol import ErrorResponse
from gateway.responses import SSE_DONE, run_unless_disconnected, sse_error
from gateway.served_model import ServedModel
from gateway.usage import UsageCounter
from pdserve.engine.request import TokenLogprob

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorResponse,
        "description": "invalid request (bad field, value out of range, request limit or context length exceeded)",
    },
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "the body is larger than max_request_body_bytes"},
    429: {"model": ErrorResponse, "description": "every node is full; retry later"},
    503: {"model": ErrorResponse, "description": "no healthy node"},
}


def streamed_responses(chunk_model: type) -> dict[int | str, dict[str, Any]]:
    """Documents `stream: true`: the chunk model (registered by app.py) under text/event-stream."""
    ref = {"$ref": f"#/components/schemas/{chunk_model.__name__}"}
    description = f"JSON body, or with `stream: true` `data: <{chunk_model.__name__}>` events and `data: [DONE]`"
    return {200: {"description": description, "content": {"text/event-stream": {"schema": ref}}}, **ERROR_RESPONSES}


def check_model(served_model: ServedModel, requested: str | None) -> None:
    try:
        served_model.check_name(requested)
    except ValueError as exc:
        raise RequestError(str(exc), param="model", code="model_not_found", status_code=404) from exc


@dataclass
class ChoiceResult:
    """Everything one choice produced (non-streamed responses)."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


async def collect_choices(
    request: Request, stream: ChoiceStream, num_choices: int, usage: UsageCounter
) -> list[ChoiceResult]:
    """Waits for every choice to finish (cancelled if the client leaves), then closes the stream."""
    try:
        return await run_unless_disconnected(request, _collect(stream, num_choices, usage))
    finally:
        await stream.aclose()


async def _collect(stream: ChoiceStream, num_choices: int, usage: UsageCounter) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(num_choices)]
    async for delta in stream:
        usage.add(delta)
        result = results[delta.index]
        result.text += delta.text
        result.logprobs += delta.logprobs
        result.finish_reason = delta.finish_reason or result.finish_reason
    return results


async def end_with_done(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The events, then `data: [DONE]`; an error after the 200 becomes an error event first."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        logger.warning("stream failed after the response started: %r", exc)
        yield sse_error(exc)
    finally:
        await events.aclose()
    yield SSE_DONE
