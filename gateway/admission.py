"""Admission control: the gateway takes on a bounded amount of work per phase, and answers 429
with `Retry-After` past it, before any response has started.

    prefill phase  prompt tokens admitted whose first token has not come back yet
                   (at most `admission_prompt_tokens_per_prefill_node` x prefill nodes)
    decode phase   streams admitted and not finished
                   (at most `admission_streams_per_decode_node` x decode nodes)

Colocated nodes count for both phases. The limits grow and shrink with the nodes the backend
sees, so scaling a phase out admits more of its work. Inside the limits nothing is refused for
being busy: requests wait in the nodes' queues (the decode side under a lease), which is what
the limits bound. A prompt larger than the whole prefill limit is still admitted when no other
prompt is waiting, so no request is refused forever.

Lifecycle of one admitted generation (`AdmissionControl.generate`):
  1. admit: count its prompt tokens and its stream, or raise OVERLOADED (429) at once;
  2. its first chunk (the first token) leaves the prefill phase: its prompt tokens are uncounted;
  3. its end (done, failed, closed by the client) leaves the decode phase: its stream is uncounted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from gateway.backend import BackendError, BackendErrorKind, GenerationBackend, GenerationChunk
from gateway.settings import AdmissionOptions
from pdserve.engine.sampling_params import SamplingParams

ADMITTED = Gauge(
    "pdserve_gateway_admitted", "Work admitted and not done, per phase (prompt tokens, streams)", ["phase"]
)
ADMISSION_LIMIT = Gauge(
    "pdserve_gateway_admission_limit", "Admission limit per phase, for the nodes seen now", ["phase"]
)
REJECTED = Counter(
    "pdserve_gateway_admission_rejected", "Generations refused with 429, by the phase that was full", ["phase"]
)

PREFILL, DECODE = "prefill_tokens", "decode_streams"


class OverloadedError(BackendError):
    """OVERLOADED with the seconds after which a retry may succeed (the `Retry-After` header)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(BackendErrorKind.OVERLOADED, message)
        self.retry_after_s = retry_after_s


@dataclass
class _Ticket:
    num_prompt_tokens: int
    in_prefill: bool = True
    released: bool = False


class AdmissionControl:
    """A GenerationBackend that admits work into the one it wraps; mutates only its own counts."""

    def __init__(self, backend: GenerationBackend, options: AdmissionOptions) -> None:
        self.backend = backend
        self.options = options
        self.num_prompt_tokens = 0  # admitted, first token not back yet
        self.num_streams = 0  # admitted, not finished

    def is_ready(self) -> bool:
        return self.backend.is_ready()

    def num_nodes_by_role(self) -> dict[str, int]:
        return self.backend.num_nodes_by_role()

    def limits(self) -> tuple[int, int]:
        """(prompt tokens, streams) the nodes seen now can be given."""
        nodes = self.backend.num_nodes_by_role()
        colocated = nodes.get("colocated", 0)
        num_prefill, num_decode = nodes.get("prefill", 0) + colocated, nodes.get("decode", 0) + colocated
        return (
            max(1, num_prefill) * self.options.admission_prompt_tokens_per_prefill_node,
            max(1, num_decode) * self.options.admission_streams_per_decode_node,
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        # Admitted on the first step, so a stream that is never started holds nothing.
        ticket = self._admit(len(prompt_token_ids))
        try:
            async with aclosing(self.backend.generate(request_id, prompt_token_ids, params)) as chunks:
                async for chunk in chunks:
                    self._leave_prefill(ticket)
                    yield chunk
        finally:
            self._release(ticket)

    def _admit(self, num_prompt_tokens: int) -> _Ticket:
        max_tokens, max_streams = self.limits()
        ADMISSION_LIMIT.labels(PREFILL).set(max_tokens)
        ADMISSION_LIMIT.labels(DECODE).set(max_streams)
        # An oversized prompt still goes when nothing else waits: it would never fit otherwise.
        if self.num_prompt_tokens and self.num_prompt_tokens + num_prompt_tokens > max_tokens:
            self._refuse(
                PREFILL, f"{self.num_prompt_tokens} prompt tokens are waiting for prefill (limit {max_tokens})"
            )
        if self.num_streams + 1 > max_streams:
            self._refuse(DECODE, f"{self.num_streams} streams are running (limit {max_streams})")
        self._add(num_prompt_tokens, 1)
        return _Ticket(num_prompt_tokens)

    def _refuse(self, phase: str, why: str) -> None:
        REJECTED.labels(phase).inc()
        retry_after_s = self.options.admission_retry_after_s
        raise OverloadedError(f"the cluster is at capacity: {why}; retry after {retry_after_s} s", retry_after_s)

    def _leave_prefill(self, ticket: _Ticket) -> None:
        if ticket.in_prefill:
            ticket.in_prefill = False
            self._add(-ticket.num_prompt_tokens, 0)

    def _release(self, ticket: _Ticket) -> None:
        if not ticket.released:
            self._leave_prefill(ticket)
            ticket.released = True
            self._add(0, -1)

    def _add(self, num_prompt_tokens: int, num_streams: int) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.num_streams += num_streams
        ADMITTED.labels(PREFILL).set(self.num_prompt_tokens)
        ADMITTED.labels(DECODE).set(self.num_streams)
