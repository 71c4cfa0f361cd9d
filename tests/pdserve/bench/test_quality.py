"""`pdserve bench quality`'s report: each mode's floor from the bandwidth measured around its own
steps, and the step's ratio to it; the batch-1 figures come from one decode step per position."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import quality
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.config import CacheConfig
from tests.factories import build_tiny_model


def test_each_modes_floor_uses_the_bandwidth_measured_around_its_own_steps(monkeypatch):
    readings = iter([40.0, 60.0, 20.0, 20.0])  # GB/s: before and after each mode's steps
    monkeypatch.setattr(quality, "read_bandwidth_gbps", lambda: next(readings))
    monkeypatch.setattr(quality, "decode_step_ms", lambda engine, prompt, num_tokens: 10.0)
    monkeypatch.setattr(quality, "weight_bytes_per_step", lambda engine: 100_000_000)
    monkeypatch.setattr(quality, "perplexity", lambda engine, text, logits_of=None: 50.0)
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
    row = "| {} | float16 | 100.0% | 12/12 | none | 50.000 (1.0000) | 100.0% | 1.0000 | 10.0 | {} |"
    assert row.format("int8", "50.0 | 2.0 | 5.00") in table
    assert row.format("int4", "20.0 | 5.0 | 2.00") in table


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_batch1_logits_decode_one_position_a_step_to_what_the_prefill_computes(tmp_path, quantization):
    """Each position attends to the cache the steps before it wrote: float32 gives the prefill's
    logits to float rounding, and the quantized modes their own rounding of one row of x apart."""
    folder = build_tiny_model(tmp_path)
    cache = CacheConfig(block_size=8)
    engine = LLMEngine(EngineConfig(model=str(folder), quantization=quantization, attention_backend="cpu", cache=cache))
    token_ids = list(range(3, 23))  # 20 positions over three blocks
    stepped, prefilled = quality.batch1_logits(engine, token_ids), quality.sequence_logits(engine, token_ids)
    assert stepped.shape == prefilled.shape == (20, engine.model_runner.model.config.vocab_size)
    # Of the largest logit: int8 rounds x to int16 either way; int4 at batch 1 on AVX2 to int8 per
    # group (1.5e-2 on a Zen 3), not int16 per row.
    tolerance = {"none": 1e-5, "int8": 1e-3, "int4": 0.05}[quantization]
    torch.testing.assert_close(stepped, prefilled, rtol=0, atol=tolerance * float(prefilled.abs().max()))
