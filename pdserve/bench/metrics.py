"""Serving metrics as vLLM's benchmark defines them, computed from per-request timestamps.

Per request (all times from the moment the request was sent):

    sent          first content      ...      last content      stream closed
     |-------------------|-----|-----|-----------|--------------------|
     <------ TTFT ------>< ITL >< ITL >   ...                         |
     <------------------------------- E2E --------------------------->

    TPOT = (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token

ITLs are the gaps between successive chunks that carried content; they are pooled over all
requests before taking percentiles. Throughputs divide by the benchmark's wall duration. Failed
requests are counted but take no part in any latency, token count or throughput.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request; times are seconds on one monotonic clock."""

    start_s: float
    end_s: float
    content_times_s: tuple[float, ...] = ()  # arrival of each chunk that carried content
    num_output_tokens: int | None = None  # usage.completion_tokens; None: count content chunks
    num_prompt_tokens: int | None = None  # usage.prompt_tokens
    error: str | None = None

    def __post_init__(self):
        if self.error is None and not self.content_times_s:
            raise ValueError("a request without content must be recorded as failed (set error)")

    @property
    def succeeded(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        # Without usage, one content chunk stands for one token (an undercount where a chunk holds several).
        return self.num_output_tokens if self.num_output_tokens is not None else len(self.content_times_s)

    @property
    def ttft_s(self) -> float:
        return self.content_times_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """None for a single output token: there is no time *per output token* after the first."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.content_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None leaves that metric unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        for name, value in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)):
            if value is not None and value <= 0:
                raise ValueError(f"SLO {name} must be positive, got {value}")

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def is_met(self, record: RequestRecord) -> bool:
        """A single-token request has no TPOT and counts as meeting a TPOT SLO, as in vLLM."""
        if self.ttft_ms is not None and record.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot_s = record.tpot_s
        return self.tpot_ms is None or tpot_s is None or tpot_s * 1000 <= self.tpot_ms


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Distribution | None:
        """None when there is nothing to summarise (every request failed, or none had TPOT)."""
        if not values_s:
            return None
        values_ms = np.asarray(values_s, dtype=np.float64) * 1000
        # np.percentile's default linear interpolation, as vLLM's benchmark uses.
        p50, p90, p99 = np.percentile(values_ms, PERCENTILES)
        return cls(len(values_ms), float(values_ms.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class BenchmarkMetrics:
    num_requests: int
    num_succeeded: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # succeeded requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s meeting every SLO; None without SLOs
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    errors: tuple[str, ...] = ()  # distinct error messages of failed requests, first seen first


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo()) -> BenchmarkMetrics:
    """Metrics of one benchmark run; `duration_s` is its wall time, first send to last response."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    succeeded = [record for record in records if record.succeeded]
    total_input_tokens = sum(record.num_prompt_tokens or 0 for record in succeeded)
    total_output_tokens = sum(record.output_tokens for record in succeeded)
    goodput = sum(slo.is_met(record) for record in succeeded) / duration_s if slo.is_set else None
    return BenchmarkMetrics(
        num_requests=len(records),
        num_succeeded=len(succeeded),
        num_failed=len(records) - len(succeeded),
        duration_s=duration_s,
        total_input_tokens=total_input_tokens,
        total_output_tokens=total_output_tokens,
        request_throughput=len(succeeded) / duration_s,
        output_throughput=total_output_tokens / duration_s,
        total_token_throughput=(total_input_tokens + total_output_tokens) / duration_s,
        goodput=goodput,
        ttft=Distribution.of_seconds([record.ttft_s for record in succeeded]),
        tpot=Distribution.of_seconds([r.tpot_s for r in succeeded if r.tpot_s is not None]),
        itl=Distribution.of_seconds([itl for record in succeeded for itl in record.itls_s]),
        e2e=Distribution.of_seconds([record.e2e_s for record in succeeded]),
        errors=tuple(dict.fromkeys(record.error for record in records if record.error is not None)),
    )
