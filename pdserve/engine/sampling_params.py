"""Per-request sampling parameters (OpenAI-style), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1.0 disables top-p.
    `seed` makes sampling reproducible per request, whatever else shares the batch.
    `logprobs` None returns nothing; N >= 0 returns the sampled token's log-probability
    plus the N most likely alternatives.
    `num_prior_output_tokens`: output tokens generated before this request began (a stream
    resumed on another node, whose prompt ends with them): the next token is output number
    `num_prior_output_tokens`, and a seeded request draws for it what the uninterrupted one would.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    num_prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive count, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.num_prior_output_tokens < 0:
            raise ValueError(f"num_prior_output_tokens must be >= 0, got {self.num_prior_output_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
