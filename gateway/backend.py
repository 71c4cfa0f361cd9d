"""The gateway's view of the cluster: something that turns a tokenized prompt into a stream of
token chunks. The disaggregated backend (prefill node -> KV transfer -> decode node) and the
colocated one both implement it; tests use a fake."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class GenerationChunk:
    """New tokens of one request, in order; the last chunk carries the finish reason."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when requested
    finish_reason: str | None = None  # "stop" (EOS / stop token), "length", "abort"
    num_cached_tokens: int = 0
    route: str | None = None  # first chunk: which nodes serve the request (`x-pdserve-route`)


class BackendErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the request cannot be served as asked (HTTP 400)
    OVERLOADED = "overloaded"  # every candidate node is full (HTTP 429)
    UNAVAILABLE = "unavailable"  # no healthy node / a node failed mid-request (HTTP 503)


class BackendError(Exception):
    def __init__(self, kind: BackendErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class GenerationBackend(Protocol):
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        """Streams the request's tokens (an async generator is one). Closing the iterator early
        (stop string, client gone) cancels the request on the nodes. Raises BackendError."""
        ...

    def is_ready(self) -> bool:
        """True when at least one node of each needed role is registered."""
        ...

    def num_nodes_by_role(self) -> dict[str, int]:
        """The nodes the backend routes to now, per role (what `/health` reports)."""
        ...
