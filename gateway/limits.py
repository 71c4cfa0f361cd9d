"""Bounds on what one request may ask for (the `RequestLimitOptions` settings): the body size,
checked by an ASGI middleware before the body is read whole, and the limits that need the served
model or the settings (vocabulary, choices, stop sequences, logprobs, max_tokens), checked by the
routes before any prompt is tokenized. The request models check what needs neither."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import RequestError, to_openai_error
from gateway.protocol import INT64_MAX, SamplingRequest
from gateway.settings import RequestLimitOptions

REQUEST_TOO_LARGE = 413


def get_request_limits(request: Request) -> RequestLimitOptions:
    return request.app.state.request_limits


RequestLimitsDep = Annotated[RequestLimitOptions, Depends(get_request_limits)]


def check_request_limits(
    body: SamplingRequest,
    limits: RequestLimitOptions,
    *,
    vocab_size: int,
    num_prompts: int,
    requested_max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str,
) -> None:
    """Raises a 400 RequestError naming the first field beyond a limit."""
    if num_prompts * body.n > limits.max_choices_per_request:
        raise RequestError(
            f"{num_prompts} prompt(s) x n={body.n} asks for {num_prompts * body.n} generations; "
            f"at most {limits.max_choices_per_request} per request",
            param="n",
        )
    _check_stop(body, limits, vocab_size)
    if body.top_k is not None and body.top_k > vocab_size:
        raise RequestError(f"top_k must be at most the vocabulary size ({vocab_size}), or 0 / -1", param="top_k")
    if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
        raise RequestError(f"seed + n - 1 must be at most {INT64_MAX} (choice i samples with seed + i)", param="seed")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise RequestError(f"{logprobs_param} must be at most {limits.max_logprobs}", param=logprobs_param)
    max_output_tokens = limits.max_output_tokens
    if requested_max_tokens is not None and max_output_tokens is not None and requested_max_tokens > max_output_tokens:
        raise RequestError(f"max_tokens must be at most {max_output_tokens}", param="max_tokens")


def _check_stop(body: SamplingRequest, limits: RequestLimitOptions, vocab_size: int) -> None:
    stop_strings = body.stop_strings
    if len(stop_strings) > limits.max_stop_strings:
        raise RequestError(f"at most {limits.max_stop_strings} stop strings per request", param="stop")
    if any(len(stop) > limits.max_stop_string_chars for stop in stop_strings):
        raise RequestError(f"a stop string may have at most {limits.max_stop_string_chars} characters", param="stop")
    stop_token_ids = body.stop_token_ids or []
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError(f"at most {limits.max_stop_token_ids} stop_token_ids per request", param="stop_token_ids")
    if any(token_id >= vocab_size for token_id in stop_token_ids):
        raise RequestError(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")


class BodySizeLimitMiddleware:
    """413 for a body over `max_body_bytes`: at once when Content-Length says so, else as soon as the
    streamed (chunked) body passes it. The body is buffered up to the limit, then replayed to the app."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_body_bytes:
            await self._send_too_large(send)
            return
        messages: list[Message] = []
        num_bytes = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app sees the disconnect
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                await self._send_too_large(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0  # the server rejects a malformed one itself
        return 0

    async def _send_too_large(self, send: Send) -> None:
        message = f"the request body is larger than {self.max_body_bytes} bytes"
        status, body = to_openai_error(RequestError(message, code="request_too_large", status_code=REQUEST_TOO_LARGE))
        content = body.model_dump_json().encode()
        # The rest of the body stays unread, so this connection cannot carry another request.
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": [*headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The buffered messages, then the server's own receive (a disconnect, later)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
