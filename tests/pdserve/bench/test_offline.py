"""The offline benchmark's runners and result arithmetic, on a tiny random-weight Llama."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pdserve.bench import offline
from pdserve.bench.offline import Measurement
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine

INPUT_LEN = 12
OUTPUT_LEN = 5


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tiny_folder):
    return offline.load_peer_model(tiny_folder)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (INPUT_LEN + i,), generator=generator).tolist() for i in range(3)]


class WordTokenizer:
    """Stands in for a HF tokenizer: one id per word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [sum(map(ord, word)) for word in text.split()]


def test_synthetic_prompts_are_exact_length_distinct_and_deterministic():
    first = offline.synthetic_prompts(WordTokenizer(), 4, 30, tag="t")
    assert [len(p) for p in first] == [30] * 4
    assert len({tuple(p) for p in first}) == 4
    assert offline.synthetic_prompts(WordTokenizer(), 4, 30, tag="t") == first
    assert offline.synthetic_prompts(WordTokenizer(), 4, 30, tag="u") != first


def test_naive_and_generate_batch_produce_exactly_output_len_tokens(tiny_model, prompts):
    naive = offline.run_naive(tiny_model, prompts, OUTPUT_LEN)
    batched = offline.run_generate_batch(tiny_model, prompts, OUTPUT_LEN)
    assert [len(ids) for ids in naive] == [OUTPUT_LEN] * len(prompts)
    assert [len(ids) for ids in batched] == [OUTPUT_LEN] * len(prompts)
    # Both are greedy float32 over the same weights, returned in input order.
    assert batched == naive


def test_pdserve_runner_matches_naive(tiny_folder, tiny_model, prompts):
    engine = LLMEngine(EngineConfig(model=str(tiny_folder), cache=CacheConfig(num_blocks=64)))
    outputs = offline.run_pdserve(engine, prompts, OUTPUT_LEN)
    assert outputs == offline.run_naive(tiny_model, prompts, OUTPUT_LEN)


def test_eos_does_not_stop_either_peer(tiny_model, prompts):
    # Make the first greedy token the EOS token: it must not end the request.
    first_token = offline.run_naive(tiny_model, prompts[:1], 1)[0][0]
    tiny_model.config.eos_token_id = tiny_model.generation_config.eos_token_id = first_token
    try:
        assert len(offline.run_naive(tiny_model, prompts[:1], OUTPUT_LEN)[0]) == OUTPUT_LEN
        assert len(offline.run_generate_batch(tiny_model, prompts[:1], OUTPUT_LEN)[0]) == OUTPUT_LEN
    finally:
        tiny_model.config.eos_token_id = tiny_model.generation_config.eos_token_id = 2


def test_time_system_rejects_short_outputs(prompts):
    with pytest.raises(RuntimeError, match="expected 3 x 5 tokens"):
        offline.time_system("broken", lambda ps, n: [[0] * (n - 1) for _ in ps], prompts, OUTPUT_LEN, 3)


def test_measure_times_naive_on_at_most_naive_max_requests():
    calls = []

    def runner(prompts, output_len):
        calls.append(len(prompts))
        return [[0] * output_len for _ in prompts]

    measurements = offline.measure(
        {"pdserve": runner, "naive": runner},
        WordTokenizer(),
        [1, 8],
        input_len=10,
        output_len=4,
        naive_max_requests=4,
    )
    assert calls == [2, 2, 1, 1, 8, 4]  # warm-ups, then concurrency 1, then 8
    assert [(m.system, m.concurrency, m.num_requests, m.num_output_tokens) for m in measurements] == [
        ("pdserve", 1, 1, 4),
        ("naive", 1, 1, 4),
        ("pdserve", 8, 8, 32),
        ("naive", 8, 4, 16),
    ]


MEASUREMENTS = [
    Measurement("pdserve", 1, 1, 64, 2.0),  # 32 tok/s, 31.25 ms/token
    Measurement("naive", 1, 1, 64, 1.6),  # 40 tok/s, 25 ms/token
    Measurement("generate_batch", 1, 1, 64, 4.0),  # 16 tok/s
    Measurement("pdserve", 32, 32, 2048, 4.0),  # 512 tok/s
    Measurement("naive", 32, 4, 256, 6.4),  # 40 tok/s
    Measurement("generate_batch", 32, 32, 2048, 8.0),  # 256 tok/s
]


def test_ratios():
    assert offline.ratio(MEASUREMENTS, "pdserve", "naive", 1) == pytest.approx(0.8)
    assert offline.ratio(MEASUREMENTS, "pdserve", "naive", 32) == pytest.approx(12.8)
    assert offline.ratio(MEASUREMENTS, "pdserve", "generate_batch", 32) == pytest.approx(2.0)
    assert offline.ratio(MEASUREMENTS, "pdserve", "generate_batch", 8) is None


def test_format_table():
    lines = offline.format_table(MEASUREMENTS, naive_max_requests=4).splitlines()
    assert lines[0].split() == [
        "concurrency",
        "pdserve",
        "tok/s",
        "naive",
        "tok/s",
        "generate_batch",
        "tok/s",
        "pdserve/naive",
        "pdserve/generate_batch",
    ]
    assert lines[1].split() == ["1", "32.0", "40.0", "16.0", "0.80x", "2.00x"]
    assert lines[2].split() == ["32", "512.0", "40.0", "256.0", "12.80x", "2.00x"]
    assert "pdserve 31.2 ms, naive 25.0 ms (pdserve/naive 1.25x)" in lines[3]
    assert "min(N, 4)" in lines[4]


def test_format_table_without_peers_has_no_ratio_columns():
    table = offline.format_table([m for m in MEASUREMENTS if m.system == "pdserve"], naive_max_requests=4)
    assert table.splitlines()[0].split() == ["concurrency", "pdserve", "tok/s"]


def test_to_json_round_trips():
    args = offline.parse_args(["--concurrency", "1,32", "--json", "out.json"])
    data = json.loads(json.dumps(offline.to_json(MEASUREMENTS, args)))
    assert data["ratios"]["pdserve/naive"] == {"1": pytest.approx(0.8), "32": pytest.approx(12.8)}
    assert data["measurements"][3]["tokens_per_s"] == 512.0
    assert data["args"]["concurrency"] == [1, 32]


def test_parse_args_rejects_unknown_systems():
    with pytest.raises(SystemExit):
        offline.parse_args(["--systems", "pdserve,vllm"])
