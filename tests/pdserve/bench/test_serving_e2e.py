"""`pdserve bench serve` against a real local cluster (Launcher: embedded Redis, prefill, decode,
gateway) on the tiny random-weight chat model."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main as pdserve
from pdserve.cluster_state.embedded_redis import free_port
from pdserve.launcher import Launcher, LaunchPlan
from tests.factories import build_tiny_chat_model

pytestmark = pytest.mark.timeout(180)

NUM_REQUESTS = 8
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    plan = LaunchPlan(model=str(model), port=free_port(), node_args=("--kv-cache-gib", "0.05"), ready_timeout_s=120)
    with Launcher(plan) as cluster:
        yield cluster.base_url


def test_bench_serve_reports_sane_metrics_and_json(base_url, tmp_path, capsys):
    results_path = tmp_path / "results.json"
    assert (
        pdserve(
            [
                "bench",
                "serve",
                "--base-url",
                base_url,
                "--num-requests",
                str(NUM_REQUESTS),
                "--concurrency",
                "4",
                "--input-len",
                "24",
                "--output-len",
                str(OUTPUT_LEN),
                "--json",
                str(results_path),
                "--slo-ttft-ms",
                "60000",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "== concurrency 4:" in printed and "output token throughput (tok/s)" in printed

    results = json.loads(results_path.read_text())
    (level,) = results["levels"]
    metrics = level["metrics"]
    assert level["load"]["concurrency"] == 4
    assert (metrics["num_requests"], metrics["num_succeeded"], metrics["num_failed"]) == (NUM_REQUESTS, NUM_REQUESTS, 0)
    # ignore_eos + max_tokens fix every output; the usage chunk counts the prompt.
    assert metrics["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert all(r["output_tokens"] == OUTPUT_LEN and r["prompt_tokens"] >= 20 for r in level["requests"])
    assert metrics["ttft"]["p50"] > 0 and metrics["tpot"]["p50"] > 0 and metrics["e2e"]["p99"] >= metrics["ttft"]["p99"]
    # One gap between consecutive content chunks; a chunk may hold several tokens (an incomplete UTF-8 character).
    num_gaps = [len(r["itls_ms"]) for r in level["requests"]]
    assert metrics["itl"]["count"] == sum(num_gaps) and all(1 <= n <= OUTPUT_LEN - 1 for n in num_gaps), num_gaps
    assert metrics["output_throughput"] > 0 and metrics["request_throughput"] > 0
    assert metrics["goodput"] == pytest.approx(metrics["request_throughput"])  # a 60 s TTFT SLO is met by all


def test_bench_serve_multi_turn_chat_sweep(base_url, tmp_path, capsys):
    results_path = tmp_path / "results.json"
    pdserve(
        [
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--endpoint",
            "chat",
            "--workload",
            "multi-turn",
            "--num-turns",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-requests",
            "4",
            "--concurrency",
            "1,2",
            "--json",
            str(results_path),
            "--no-progress",
        ]
    )
    assert "sweep (latencies in ms)" in capsys.readouterr().out
    levels = json.loads(results_path.read_text())["levels"]
    assert [level["load"]["concurrency"] for level in levels] == [1, 2]
    for level in levels:
        assert level["metrics"]["num_succeeded"] == 4
        prompt_tokens = [r["prompt_tokens"] for r in level["requests"]]
        # Closed loop at concurrency 1: turn 1 holds turn 0 and its reply, so it is the longer prompt.
        if level["load"]["concurrency"] == 1:
            assert prompt_tokens[1] > prompt_tokens[0] and prompt_tokens[3] > prompt_tokens[2]


def test_bench_serve_plots_a_sweep(base_url, tmp_path):
    pytest.importorskip("matplotlib")
    plot_dir = tmp_path / "plots"
    pdserve(
        [
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--num-requests",
            "2",
            "--concurrency",
            "1,2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--plot",
            str(plot_dir),
            "--no-progress",
        ]
    )
    assert sorted(p.name for p in plot_dir.iterdir()) == [
        "cdf_e2e.png",
        "cdf_itl.png",
        "cdf_tpot.png",
        "cdf_ttft.png",
        "sweep_throughput.png",
        "sweep_ttft.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in plot_dir.iterdir())
