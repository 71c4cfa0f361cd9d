"""Errors -> HTTP status and the OpenAI error body, in one table. Every failure a client sees is
`{"error": {"message", "type", "param", "code"}}`, never FastAPI's `{"detail": ...}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.backend import BackendError, BackendErrorKind
from gateway.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads the body

_BACKEND_STATUS = {
    BackendErrorKind.INVALID_REQUEST: 400,
    BackendErrorKind.OVERLOADED: 429,
    BackendErrorKind.UNAVAILABLE: 503,
}

_ERROR_TYPE = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    CLIENT_CLOSED_REQUEST: "invalid_request_error",
}


class RequestError(Exception):
    """A request the gateway refuses, with the request field at fault (400 unless told otherwise)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code


def to_openai_error(exc: Exception, request: Request | None = None) -> tuple[int, ErrorResponse]:
    """The table: which status and body an exception becomes."""
    match exc:
        case RequestValidationError():
            status, message, param, code = 400, _validation_message(exc), _validation_param(exc), None
        case RequestError():
            status, message, param, code = exc.status_code, exc.message, exc.param, exc.code
        case BackendError():
            status, message, param, code = _BACKEND_STATUS[exc.kind], exc.message, None, exc.kind.value
        case HTTPException(status_code=404) if request is not None:
            status, message, param, code = 404, f"Invalid URL ({request.method} {request.url.path})", None, "not_found"
        case HTTPException():
            status, message, param, code = exc.status_code, str(exc.detail), None, None
        case _:
            status, message, param, code = 500, "internal server error", None, None
    error_type = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code))


def install_error_handlers(app: FastAPI) -> None:
    for exc_class in (RequestValidationError, RequestError, BackendError, HTTPException):
        app.add_exception_handler(exc_class, _handle)
    app.add_middleware(UnhandledErrorMiddleware)


class UnhandledErrorMiddleware:
    """Any other exception becomes a 500 OpenAI error here. Starlette's own catch-all re-raises after
    its 500, which makes the server close the keep-alive connection; this one does not."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response_started = False

        async def tracking_send(message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if response_started:
                raise  # too late for an error response: the server ends the connection
            response = await _handle(Request(scope), exc)
            await response(scope, receive, send)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    status, body = to_openai_error(exc, request)
    if status >= 500 and not isinstance(exc, (BackendError, HTTPException)):
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    headers = getattr(exc, "headers", None)  # 405 carries its Allow header
    if status == 429:  # overloaded: say when to come back (admission knows; a full node: soon)
        headers = {"Retry-After": str(getattr(exc, "retry_after_s", DEFAULT_RETRY_AFTER_S))}
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_param(exc: RequestValidationError) -> str | None:
    """The top-level request field at fault, as OpenAI reports it ("temperature", "messages")."""
    for error in exc.errors():
        loc = error.get("loc", ())
        if len(loc) > 1 and loc[0] == "body" and isinstance(loc[1], str):
            return loc[1]
    return None


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        if error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
            continue
        field = ".".join(str(part) for part in error.get("loc", ())[1:]) or "body"
        parts.append(f"{field}: {error['msg']}")
    return "; ".join(parts) or "invalid request"
