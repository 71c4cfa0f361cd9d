"""`pdserve bench quality`'s report: each mode's floor from the bandwidth measured around its own
steps, and the step's ratio to it."""

from __future__ import annotations

from pdserve.bench import quality


def test_each_modes_floor_uses_the_bandwidth_measured_around_its_own_steps(monkeypatch):
    readings = iter([40.0, 60.0, 20.0, 20.0])  # GB/s: before and after each mode's steps
    monkeypatch.setattr(quality, "read_bandwidth_gbps", lambda: next(readings))
    monkeypatch.setattr(quality, "decode_step_ms", lambda engine, prompt, num_tokens: 10.0)
    monkeypatch.setattr(quality, "weight_bytes_per_step", lambda engine: 100_000_000)
    monkeypatch.setattr(quality, "perplexity", lambda engine, text: 50.0)
    monkeypatch.setattr(quality, "greedy", lambda engine, prompts, num_tokens: [[1, 2]] * len(prompts))
    monkeypatch.setattr(quality, "teacher_forced_agreement", lambda *args: 1.0)

    class FakeEngine:
        def __init__(self, config) -> None:
            self.config = config
            self.tokenizer = lambda text: {"input_ids": [1, 2, 3]}

    monkeypatch.setattr(quality, "LLMEngine", FakeEngine)
    report = quality.measure("smollm2-135m", ["int8", "int4"], num_tokens=2, attention_backend="cpu")

    int8, int4 = report["modes"]["int8"], report["modes"]["int4"]
    assert int8["read_bandwidth_gbps"] == 50.0 and int8["floor_ms"] == 2.0
    assert int4["read_bandwidth_gbps"] == 20.0 and int4["floor_ms"] == 5.0
    assert int8["kv_cache"] == int4["kv_cache"] == "float16"  # auto under quantized weights
    table = quality.format_table(report)
    assert "| int8 | float16 | 100.0% | 12/12 | none | 50.000 (1.0000) | 10.0 | 50.0 | 2.0 | 5.00 |" in table
    assert "| int4 | float16 | 100.0% | 12/12 | none | 50.000 (1.0000) | 10.0 | 20.0 | 5.0 | 2.00 |" in table
