"""`--kv-cache-dtype`: the KV cache in float16 or bfloat16 under float32 weights (half the bytes
per token), or in the model's own dtype (auto)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.config import CacheConfig
from tests.factories import build_tiny_model


def test_auto_is_the_models_dtype_and_other_values_are_refused():
    assert EngineConfig().kv_cache_dtype == "float32"
    assert EngineConfig(dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(cache=CacheConfig(dtype="float16")).kv_cache_dtype == "float16"
    assert EngineConfig(cache=CacheConfig(dtype="bfloat16")).kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="KV cache dtype must be one of auto, float32, bfloat16, float16"):
        CacheConfig(dtype="int8")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_auto_under_quantized_weights_is_float16_unless_a_dtype_is_named(quantization):
    # Quantized weights already round; a float16 cache halves the bytes attention reads (and is
    # llama.cpp's default). A named dtype, float32 included, is kept.
    assert EngineConfig(quantization=quantization).kv_cache_dtype == "float16"
    named = CacheConfig(dtype="float32")
    assert EngineConfig(quantization=quantization, cache=named).kv_cache_dtype == "float32"


def test_the_triton_backend_keeps_the_models_dtype():
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 under --dtype bfloat16 needs --attention-backend"):
        EngineConfig(dtype="bfloat16", attention_backend="triton", cache=CacheConfig(dtype="float16"))
    assert EngineConfig(dtype="bfloat16", attention_backend="triton", cache=CacheConfig(dtype="bfloat16"))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_16_bit_cache_holds_twice_the_tokens_in_the_same_memory(tmp_path, backend):
    folder = build_tiny_model(tmp_path)

    def engine(kv_dtype: str) -> LLMEngine:
        cache = CacheConfig(dtype=kv_dtype, kv_cache_memory_bytes=1 << 22)
        return LLMEngine(EngineConfig(model=str(folder), attention_backend=backend, cache=cache))

    full, half = engine("auto"), engine("bfloat16")
    assert half.model_runner.num_blocks == 2 * full.model_runner.num_blocks
    assert {k.dtype for k, v in half.model_runner.kv_caches} == {torch.bfloat16}
    assert {v.dtype for k, v in half.model_runner.kv_caches} == {torch.bfloat16}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7], list(range(1, 40))]
    # A random tiny model's logits are close together: rounding K and V may flip a token, but
    # the outputs stay well-formed and the float32 activations stay float32.
    outputs = half.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [16, 16]
    assert half.model_runner.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_the_default_model_with_a_16_bit_cache_keeps_float32s_greedy_tokens_on_short_prompts(kv_cache_dtype):
    # Measured in docs/benchmarks.md over the quality prompt set; here two prompts, 24 tokens.
    def engine(kv_dtype: str) -> LLMEngine:
        cache = CacheConfig(dtype=kv_dtype, kv_cache_memory_bytes=1 << 26)
        return LLMEngine(EngineConfig(model="smollm2-135m", attention_backend="cpu", cache=cache))

    reference, rounded = engine("auto"), engine(kv_cache_dtype)
    prompts = [reference.tokenizer(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    assert [o.token_ids for o in rounded.generate(prompts, params)] == expected
