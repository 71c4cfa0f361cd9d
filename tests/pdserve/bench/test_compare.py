"""The comparison's table: rows, blanks for offline systems, ratios against the peers."""

from __future__ import annotations

import pytest

from pdserve.bench import compare, engine_load
from pdserve.bench.compare import CompareRow
from pdserve.bench.engine_load import run_level
from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.offline import Measurement, synthetic_prompts
from pdserve.bench.results import LevelResult, Load, merge_rounds
from pdserve.engine import EngineConfig, LLMEngine
from tests.factories import build_tiny_model

ROWS = [
    CompareRow("naive", 8, 25.0, 4),
    CompareRow("pdserve-disagg", 8, 100.0, 8, ttft_p50=1234.4, ttft_p99=2000.0, tpot_p50=80.2, itl_p99=150.0),
    CompareRow("generate_batch", 8, 50.0, 8),
    CompareRow("pdserve-colocated", 1, 30.0, 4, ttft_p50=250.0, ttft_p99=260.0, tpot_p50=33.3, itl_p99=40.0),
]


def test_markdown_orders_rows_blanks_offline_latencies_and_gives_ratios():
    lines = compare.format_markdown(ROWS).splitlines()
    assert lines[0] == (
        "| system | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
        "| ITL p99 (ms) | vs naive | vs generate_batch |"
    )
    assert lines[2] == "| pdserve-colocated | 1 | 30.0 | 250 | 260 | 33.3 | 40 |  |  |"  # no peer measured at 1
    assert lines[3] == "| pdserve-disagg | 8 | 100.0 | 1234 | 2000 | 80.2 | 150 | 4.00x | 2.00x |"
    assert lines[4] == "| generate_batch | 8 | 50.0 |  |  |  |  | 2.00x | 1.00x |"
    assert lines[5] == "| naive | 8 | 25.0 |  |  |  |  | 1.00x | 0.50x |"


def test_rows_from_a_cluster_level_and_an_offline_measurement():
    records = [RequestRecord(0.0, 1.0, (0.5, 0.6, 0.7, 0.8, 0.9), num_output_tokens=5)]
    level = LevelResult(Load(concurrency=1, num_requests=1), compute_metrics(records, 2.0), tuple(records))
    row = compare.row_from_level("pdserve-disagg", level)
    assert (row.concurrency, row.output_throughput, row.num_requests) == (1, 2.5, 1)
    assert (row.ttft_p50, row.tpot_p50, row.itl_p99) == pytest.approx((500.0, 125.0, 100.0))
    offline_row = compare.row_from_measurement(Measurement("naive", 32, 4, 256, 6.4))
    assert (offline_row.system, offline_row.concurrency, offline_row.output_throughput) == ("naive", 32, 40.0)
    assert offline_row.ttft_p50 is None


def test_cluster_prompts_are_the_offline_peers_prompts():
    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [sum(map(ord, word)) for word in text.split()]

    conversations = compare.conversations_for(WordTokenizer(), "c8", 3, input_len=20, output_len=64)
    assert [c.turns[0][0]["content"] for c in conversations] == synthetic_prompts(WordTokenizer(), 3, 20, tag="c8")
    assert all(c.max_tokens == (64,) for c in conversations)


def test_parse_args_defaults_and_rejects_unknown_systems():
    args = compare.parse_args([])
    assert (args.model, args.concurrency, args.input_len, args.output_len) == ("smollm2-135m", [1, 8, 32], 200, 64)
    assert args.systems == ["pdserve-disagg", "pdserve-colocated", "pdserve-engine", "generate_batch", "naive"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--systems", "vllm"])


def test_the_engine_row_takes_the_engine_flags_among_a_nodes_flags(tmp_path):
    folder = build_tiny_model(tmp_path)
    engine = engine_load.engine_from_flags(
        str(folder), "--quantization int8 --attention-backend cpu --kv-transport grpc --max-num-seqs 3"
    )
    assert (engine.config.quantization, engine.config.attention_backend) == ("int8", "cpu")
    assert engine.config.scheduler.max_num_seqs == 3


def test_the_engine_under_a_closed_loop_keeps_n_requests_in_flight(tmp_path, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(build_tiny_model(tmp_path))))
    in_flight = []
    step = engine.step

    def counted_step():
        load = engine.load()
        in_flight.append(load.num_waiting_requests + load.num_running)
        return step()

    monkeypatch.setattr(engine, "step", counted_step)
    prompts = [[3 + i, 5, 7, 9] for i in range(5)]
    result = run_level(engine, Load(concurrency=2, num_requests=5), prompts, output_len=6)
    assert result.metrics.num_succeeded == 5 and result.metrics.total_output_tokens == 30
    assert result.metrics.total_input_tokens == 20
    for record in result.records:
        assert record.start_s < record.content_times_s[0] <= record.content_times_s[-1] == record.end_s
    assert result.metrics.tpot.p50 > 0 and result.metrics.ttft.p50 > 0
    assert max(in_flight) == 2 and in_flight[0] == 2


def test_the_run_line_describes_the_workload_that_ran():
    synthetic = compare.describe_run(compare.parse_args(["--input-len", "210", "--output-len", "128"]), 12.0)
    assert "prompts of 210 tokens, 128 output tokens" in synthetic and "took 12 s" in synthetic
    chat = compare.describe_run(compare.parse_args(["--workload", "chat", "--output-len", "64"]), 12.0)
    assert "chats of 4 turns of 48-token messages after one of 2 shared 512-token system prompts" in chat
    assert "prompts of 200 tokens" not in chat


def level(num_requests: int, duration_s: float, tokens: int) -> LevelResult:
    records = [RequestRecord(0.0, 1.0, (0.5,) * tokens, num_output_tokens=tokens) for _ in range(num_requests)]
    return LevelResult(
        Load(concurrency=1, num_requests=num_requests), compute_metrics(records, duration_s), tuple(records)
    )


def test_rounds_merge_into_one_level_per_concurrency():
    merged = merge_rounds([[level(2, 4.0, 10)], [level(3, 6.0, 10)]])
    assert len(merged) == 1
    assert merged[0].load.num_requests == 5 and len(merged[0].records) == 5
    assert merged[0].metrics.output_throughput == pytest.approx(50 / 10.0)


def test_each_round_has_prompts_of_its_own():
    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [sum(map(ord, word)) for word in text.split()]

    args = compare.parse_args(["--input-len", "20"])
    rounds = [compare.conversation_source(args, WordTokenizer(), {"c1": 3}, round_index=r) for r in (0, 1)]
    first, second = (list(source("c1")) for source in rounds)
    assert len(first) == len(second) == 3
    assert {c.turns[0][0]["content"] == d.turns[0][0]["content"] for c, d in zip(first, second)} == {False}


def test_paired_rounds_alternate_the_served_and_the_engine_levels(monkeypatch):
    calls = []

    class FakeLauncher:
        def __init__(self, plan) -> None:
            assert plan.colocated and plan.node_args == ("--quantization", "int8")
            self.base_url = "http://127.0.0.1:1"

        def __enter__(self):
            calls.append("up")
            return self

        def __exit__(self, *exc) -> None:
            calls.append("down")

    def fake_sweep(base_url, args, tokenizer, round_index=0):
        calls.append(f"served {round_index}")
        return [level(2, 1.0, 4)]

    def fake_engine_levels(engine, args, tokenizer, round_index=0):
        calls.append(f"engine {round_index}")
        return [level(2, 2.0, 4)]

    monkeypatch.setattr("pdserve.launcher.Launcher", FakeLauncher)
    monkeypatch.setattr(engine_load, "load_engine", lambda args, tokenizer: calls.append("engine loaded"))
    monkeypatch.setattr(compare, "sweep", fake_sweep)
    monkeypatch.setattr(engine_load, "engine_levels", fake_engine_levels)
    args = compare.parse_args(["--concurrency", "1", "--paired-rounds", "3", "--pdserve-flags", "--quantization int8"])
    served, engine = compare.run_paired(args, tokenizer=None)
    assert calls == [
        "engine loaded",
        "up",
        *(f"{system} {r}" for r in range(3) for system in ("served", "engine")),
        "down",
    ]
    assert served[0].load.num_requests == engine[0].load.num_requests == 6
    assert served[0].metrics.output_throughput == pytest.approx(24 / 3.0)
    assert engine[0].metrics.output_throughput == pytest.approx(24 / 6.0)
    with pytest.raises(SystemExit):
        compare.parse_args(["--paired-rounds", "0"])
