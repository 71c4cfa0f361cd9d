"""A request's state inside the engine, and what the engine reports per step.

Lifecycle: WAITING -> RUNNING -> FINISHED_* ; a preempted request goes back to WAITING with
its blocks freed and `num_computed_tokens` reset, and is recomputed (prompt + output so far)
when it is scheduled again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status above RUNNING is a finished one."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class TokenLogprob:
    """Log-probability of a sampled token and the most likely alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] = field(default_factory=dict)


class Request:
    """Mutable per-request state: tokens so far, how many have KV computed, status.

    The scheduler and KV cache manager mutate `status`, `num_computed_tokens` and
    `block_hashes`; the engine appends sampled tokens with `append_token`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[TokenLogprob] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()  # when the engine got it (monotonic: this process only)
        self.first_scheduled_time: float | None = None  # left the waiting queue (None: never queued)
        self.hold_kv = False  # keep the blocks after finishing (a prefill node sending pages)
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def check_stop(self) -> bool:
        """Sets a finished status if the last token ends the request; returns whether it did."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished


@dataclass
class RequestOutput:
    """What one engine step produced for one request: the new tokens since the last output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float = 0.0  # the request's timestamps (time.monotonic), for the node's metrics
    first_scheduled_time: float | None = None
    # Full history, filled in by LLMEngine.generate for offline callers.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
