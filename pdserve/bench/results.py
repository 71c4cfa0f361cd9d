"""What a serving benchmark run is made of: its load levels and each level's result. The runner
(serving.py) makes them; the report and plot writers read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics


@dataclass(frozen=True)
class Load:
    """One load level: how requests arrive, and when the level ends."""

    concurrency: int | None = None  # most requests in flight; None only with a request rate
    request_rate: float | None = None  # conversations started per second (Poisson); None: closed loop
    num_requests: int | None = None  # stop sending after this many requests ...
    duration_s: float | None = None  # ... or after this many seconds, whichever comes first

    def __post_init__(self):
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency, a request rate, or both")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s so that the run ends by itself")
        for name in ("concurrency", "request_rate", "num_requests", "duration_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def tag(self) -> str:
        """Names this level's conversation stream, so that levels never share prompts."""
        return f"c{self.concurrency}" if self.request_rate is None else f"r{self.request_rate:g}"

    @property
    def label(self) -> str:
        if self.request_rate is None:
            return f"concurrency {self.concurrency}"
        cap = "" if self.concurrency is None else f", at most {self.concurrency} in flight"
        return f"request rate {self.request_rate:g}/s{cap}"


@dataclass(frozen=True)
class LevelResult:
    load: Load
    metrics: BenchmarkMetrics
    records: tuple[RequestRecord, ...]


def round_tag(tag: str, round_index: int) -> str:
    """A level's prompt stream in one round (the first keeps the plain tag): rounds never share
    prompts, so no round finds the previous one's in the prefix cache."""
    return tag if round_index == 0 else f"{tag}/round{round_index}"


def merge_rounds(rounds: Sequence[Sequence[LevelResult]]) -> list[LevelResult]:
    """Each level's records over all rounds, as one level: throughput over the rounds' summed time."""
    merged = []
    for levels in zip(*rounds, strict=True):
        records = tuple(record for level in levels for record in level.records)
        duration_s = sum(level.metrics.duration_s for level in levels)
        load = replace(levels[0].load, num_requests=sum(level.load.num_requests for level in levels))
        merged.append(LevelResult(load, compute_metrics(records, duration_s), records))
    return merged
