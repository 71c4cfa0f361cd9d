from __future__ import annotations

from pdserve.bench.interference import format_table, percentile, token_prompt


def test_percentile_and_prompt_helpers():
    assert percentile([float(i) for i in range(100)], 50) == 50.0
    assert percentile([float(i) for i in range(100)], 99) == 99.0
    assert token_prompt(5, seed=1) == token_prompt(5, seed=1) and len(token_prompt(2000, seed=2)) == 2000


def test_table_reports_ratios_against_colocated():
    row = {
        "ttft_1000_ms": 100.0,
        "itl_p50_ms": 10.0,
        "itl_p99_ms": 20.0,
        "long_prompt_ttft_ms": 300.0,
        "num_long_prompts": 3,
    }
    coloc = {**row, "itl_p99_ms": 200.0}
    table = format_table({"disaggregated": row, "colocated": coloc})
    assert "| decode ITL p99 under long prompts (ms) | 20 | 200 | 0.10x |" in table
