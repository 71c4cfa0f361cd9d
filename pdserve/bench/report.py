"""The serving benchmark's results as text tables and as JSON."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import BenchmarkMetrics, Distribution, RequestRecord
from pdserve.bench.results import LevelResult

LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))
MAX_ERRORS_SHOWN = 5


def format_results(model: str, workload: str, results: Sequence[LevelResult]) -> str:
    """A block per level, then (for a sweep) one row per level."""
    blocks = [format_level(model, workload, result) for result in results]
    if len(results) > 1:
        blocks.append(format_sweep(results))
    return "\n\n".join(blocks)


def format_level(model: str, workload: str, result: LevelResult) -> str:
    metrics = result.metrics
    facts = [
        ("successful requests", str(metrics.num_succeeded)),
        ("failed requests", str(metrics.num_failed)),
        ("benchmark duration (s)", f"{metrics.duration_s:.2f}"),
        ("total input tokens", str(metrics.total_input_tokens)),
        ("total output tokens", str(metrics.total_output_tokens)),
        ("request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("output token throughput (tok/s)", f"{metrics.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{metrics.total_token_throughput:.1f}"),
    ]
    if metrics.goodput is not None:
        facts.append(("goodput (req/s)", f"{metrics.goodput:.2f}"))
    lines = [f"== {result.load.label}: {model}, {workload} workload =="]
    lines += [f"{name:<34}{value:>10}" for name, value in facts]
    rows = [["latency (ms)", "mean", "p50", "p90", "p99"]]
    rows += [[name, *_distribution_cells(getattr(metrics, field))] for name, field in LATENCIES]
    lines += align(rows, first_left=True)
    lines += [f"error: {error}" for error in metrics.errors[:MAX_ERRORS_SHOWN]]
    if len(metrics.errors) > MAX_ERRORS_SHOWN:
        lines.append(f"... and {len(metrics.errors) - MAX_ERRORS_SHOWN} more distinct errors")
    return "\n".join(lines)


def format_sweep(results: Sequence[LevelResult]) -> str:
    header = [
        "load",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p99",
        "E2E p50",
        "goodput",
    ]
    rows = [header]
    for result in results:
        m = result.metrics
        rows.append(
            [
                result.load.label,
                str(m.num_succeeded),
                str(m.num_failed),
                f"{m.request_throughput:.2f}",
                f"{m.output_throughput:.1f}",
                _ms(m.ttft, "p50"),
                _ms(m.ttft, "p99"),
                _ms(m.tpot, "p50"),
                _ms(m.itl, "p99"),
                _ms(m.e2e, "p50"),
                "-" if m.goodput is None else f"{m.goodput:.2f}",
            ]
        )
    return "\n".join(["sweep (latencies in ms)", *align(rows, first_left=True)])


def align(rows: Sequence[Sequence[str]], first_left: bool = False) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if first_left and i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        )
        for row in rows
    ]


def _distribution_cells(distribution: Distribution | None) -> list[str]:
    return [_ms(distribution, stat) for stat in ("mean", "p50", "p90", "p99")]


def _ms(distribution: Distribution | None, stat: str) -> str:
    return "-" if distribution is None else f"{getattr(distribution, stat):.1f}"


def to_json(model: str, args: dict[str, Any], results: Sequence[LevelResult]) -> dict:
    return {
        "model": model,
        "args": args,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "levels": [
            {
                "load": asdict(r.load),
                "metrics": metrics_to_json(r.metrics),
                "requests": [request_to_json(x) for x in r.records],
            }
            for r in results
        ],
    }


def metrics_to_json(metrics: BenchmarkMetrics) -> dict:
    return asdict(metrics) | {"errors": list(metrics.errors)}


def request_to_json(record: RequestRecord) -> dict:
    if not record.succeeded:
        return {"error": record.error, "e2e_ms": record.e2e_s * 1000}
    tpot_s = record.tpot_s
    return {
        "ttft_ms": record.ttft_s * 1000,
        "tpot_ms": None if tpot_s is None else tpot_s * 1000,
        "e2e_ms": record.e2e_s * 1000,
        "itls_ms": [itl * 1000 for itl in record.itls_s],
        "output_tokens": record.output_tokens,
        "prompt_tokens": record.num_prompt_tokens,
    }


def write_json(path: Path, model: str, args: dict[str, Any], results: Sequence[LevelResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(model, args, results), indent=2, default=str))
