"""PNG plots of serving benchmark results: latency CDFs per level, and metrics across a sweep.

matplotlib is imported here only, with the Agg backend, so that `pdserve bench serve` runs
without it unless --plot is given.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.results import LevelResult

METRIC_TO_VALUES_S = {
    "ttft": lambda r: [r.ttft_s],
    "tpot": lambda r: [] if r.tpot_s is None else [r.tpot_s],
    "itl": lambda r: r.itls_s,
    "e2e": lambda r: [r.e2e_s],
}
METRIC_TO_TITLE = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "inter-token latency",
    "e2e": "end-to-end latency",
}


def write_plots(results: Sequence[LevelResult], out_dir: Path) -> list[Path]:
    """cdf_<metric>.png for TTFT, TPOT, ITL and E2E; for a sweep also throughput and TTFT vs load."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_plot_cdf(results, metric, out_dir) for metric in METRIC_TO_VALUES_S]
    if len(results) > 1:
        paths += _plot_sweep(results, out_dir)
    return paths


def require_matplotlib() -> None:
    """Raises ValueError (before a run, not after it) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'matplotlib>=3.8'")


def latency_values_ms(records: Sequence[RequestRecord], metric: str) -> np.ndarray:
    """One metric's values over the succeeded requests, sorted, in milliseconds."""
    values = [value for r in records if r.succeeded for value in METRIC_TO_VALUES_S[metric](r)]
    return np.sort(np.asarray(values, dtype=np.float64)) * 1000


def _plot_cdf(results: Sequence[LevelResult], metric: str, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for result in results:
        values_ms = latency_values_ms(result.records, metric)
        if len(values_ms):
            fractions = np.arange(1, len(values_ms) + 1) / len(values_ms)
            axes.step(values_ms, fractions, where="post", label=result.load.label)
    axes.set(
        xlabel=f"{metric.upper()} (ms)",
        ylabel="fraction of requests" if metric != "itl" else "fraction of gaps",
        title=f"{METRIC_TO_TITLE[metric]} (CDF)",
        ylim=(0, 1.02),
    )
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    return _save(figure, out_dir / f"cdf_{metric}.png")


def _plot_sweep(results: Sequence[LevelResult], out_dir: Path) -> list[Path]:

    by_rate = results[0].load.request_rate is not None
    xs = [r.load.request_rate if by_rate else r.load.concurrency for r in results]
    xlabel = "request rate (req/s)" if by_rate else "concurrency"
    figure, axes = _sweep_axes(xs, by_rate)
    axes.plot(xs, [r.metrics.output_throughput for r in results], marker="o")
    axes.set_ylim(bottom=0)
    axes.set(xlabel=xlabel, ylabel="output tokens/s", title=f"output throughput vs {xlabel.split(' (')[0]}")
    axes.grid(alpha=0.3)
    paths = [_save(figure, out_dir / "sweep_throughput.png")]
    figure, axes = _sweep_axes(xs, by_rate)
    for stat in ("p50", "p99"):
        axes.plot(
            xs,
            [getattr(r.metrics.ttft, stat) if r.metrics.ttft else np.nan for r in results],
            marker="o",
            label=f"TTFT {stat}",
        )
    axes.set_ylim(bottom=0)
    axes.set(xlabel=xlabel, ylabel="TTFT (ms)", title=f"time to first token vs {xlabel.split(' (')[0]}")
    axes.grid(alpha=0.3)
    axes.legend()
    return paths + [_save(figure, out_dir / "sweep_ttft.png")]


def _sweep_axes(xs: Sequence[float], by_rate: bool):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    if not by_rate:
        axes.set_xscale("log")  # concurrency sweeps go 1, 8, 32, ...
    axes.set_xticks(xs, [f"{x:g}" for x in xs])
    axes.minorticks_off()
    return figure, axes


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
