"""`--attention-backend cpu`: decode attention read in place from the paged cache by the C++
kernel, against the torch backend (gather + SDPA) on the same cache, and end to end against
transformers on the default model."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.attention import BatchLayout, get_attention_backend
from tests.factories import load_reference, reference_greedy


def decode_batch(
    context_lens: list[int], num_heads: int, num_kv_heads: int, block_size: int, head_dim: int = 64, seed: int = 0
):
    """A filled cache, scattered block tables and one new token per sequence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size for table, n in zip(tables, context_lens)]
    layout = BatchLayout(
        query_lens=[1] * len(context_lens),
        context_lens=context_lens,
        block_tables=tables,
        num_decodes=len(context_lens),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
    )
    q = torch.randn(len(context_lens), num_heads, head_dim)
    k = torch.randn(len(context_lens), num_kv_heads, head_dim)
    v = torch.randn(len(context_lens), num_kv_heads, head_dim)
    return layout, (q, k, v), (k_cache, v_cache)


@pytest.mark.parametrize(
    ("context_lens", "num_heads", "num_kv_heads", "block_size", "head_dim"),
    [
        ([1], 4, 4, 16, 64),  # one token: the first step after a one-token prompt
        ([16, 17, 32, 33], 9, 3, 16, 64),  # block boundaries; the default model's GQA ratio 3
        ([5, 300, 1, 64], 8, 1, 16, 64),  # multi-query attention, mixed lengths
        ([100, 7], 6, 2, 8, 64),  # a smaller block size
        ([63, 64, 65, 129], 8, 2, 16, 128),  # the kernel's 64-token chunk edges; head size 128
        ([40, 3], 4, 2, 16, 48),  # a head size the kernel has no special case for
        ([70, 9], 10, 2, 16, 64),  # KV groups of 5 query heads
        ([130, 2], 12, 2, 16, 128),  # groups of 6, head size 128
        ([250, 66, 1], 16, 2, 16, 64),  # groups of 8
    ],
)
def test_in_place_decode_attention_equals_the_torch_backend(
    context_lens, num_heads, num_kv_heads, block_size, head_dim
):
    layout, (q, k, v), cache = decode_batch(context_lens, num_heads, num_kv_heads, block_size, head_dim)
    outputs = []
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name, num_heads, num_kv_heads, head_dim)
        cache_copy = tuple(c.clone() for c in cache)
        outputs.append(backend.forward(q, k, v, cache_copy, backend.prepare(layout)))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("context_lens", [[130], [20], [9, 2], [1, 1, 1], [70, 5, 200]])
def test_every_thread_count_splits_the_context_without_changing_the_result(context_lens, num_threads):
    # The kernel gives each thread an equal share of all positions laid end to end, cut inside a
    # sequence where a share ends: the pieces must merge back into the same softmax.
    layout, (q, k, v), cache = decode_batch(context_lens, 9, 3, 16)
    outputs = []
    previous = torch.get_num_threads()
    try:
        for name in ("torch", "cpu"):
            torch.set_num_threads(num_threads if name == "cpu" else previous)
            backend = get_attention_backend(name, 9, 3, 64)
            outputs.append(backend.forward(q, k, v, tuple(c.clone() for c in cache), backend.prepare(layout)))
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (10, 2, 64), (16, 2, 64), (4, 4, 64)]
)
def test_16_bit_caches_are_read_in_place_as_the_torch_backend_reads_them(
    cache_dtype, num_heads, num_kv_heads, head_dim
):
    # --kv-cache-dtype under float32 activations: both backends store the new K and V rounded,
    # and read the cache back as float32.
    layout, (q, k, v), cache = decode_batch([16, 17, 300, 1], num_heads, num_kv_heads, 16, head_dim)
    outputs, caches = [], []
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name, num_heads, num_kv_heads, head_dim)
        cache_copy = tuple(c.to(cache_dtype) for c in cache)
        outputs.append(backend.forward(q, k, v, cache_copy, backend.prepare(layout)))
        caches.append(cache_copy)
    assert outputs[1].dtype == torch.float32
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    slots = layout.slot_mapping
    written = caches[1][0].view(-1, num_kv_heads, head_dim)[slots]
    assert written.dtype == cache_dtype and torch.equal(written, k.to(cache_dtype))


def test_a_16_bit_cache_row_converts_whatever_the_head_size():
    # Head sizes the kernel has no special case for convert through the generic buffer.
    layout, (q, k, v), cache = decode_batch([40, 3], 4, 2, 16, 48)
    outputs = []
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name, 4, 2, 48)
        outputs.append(backend.forward(q, k, v, tuple(c.half() for c in cache), backend.prepare(layout)))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_other_dtypes_fall_back_to_the_torch_path():
    layout, (q, k, v), cache = decode_batch([20, 3], 4, 2, 16)
    backend = get_attention_backend("cpu", 4, 2, 64)
    half = [t.bfloat16() for t in (q, k, v)]
    out = backend.forward(*half, tuple(c.bfloat16() for c in cache), backend.prepare(layout))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def prefill_batch(query_len: int, context_len: int, cache_dtype: torch.dtype, block_size: int = 16):
    """One prefill chunk of `query_len` new tokens after `context_len - query_len` cached ones."""
    torch.manual_seed(4)
    num_blocks = -(-context_len // block_size)
    table = list(range(num_blocks))[::-1]  # not in order
    cache = tuple(torch.randn(num_blocks + 1, block_size, 3, 64).to(cache_dtype) for _ in range(2))
    positions = range(context_len - query_len, context_len)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])
    layout = BatchLayout([query_len], [context_len], [table], 0, slots, block_size)
    return layout, tuple(torch.randn(query_len, heads, 64) for heads in (9, 3, 3)), cache


@pytest.mark.parametrize(("query_len", "context_len"), [(40, 40), (24, 70)])  # fresh; after a cached prefix
@pytest.mark.parametrize("native_bfloat16", [True, False])
def test_prefill_chunks_attend_in_bfloat16_under_a_16_bit_cache_where_the_cpu_multiplies_it(
    monkeypatch, query_len, context_len, native_bfloat16
):
    from pdserve.engine.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "fast_bfloat16_matmul", lambda: native_bfloat16)
    for cache_dtype in (torch.float16, torch.float32):
        layout, (q, k, v), cache = prefill_batch(query_len, context_len, cache_dtype)
        outputs = []
        for name in ("torch", "cpu"):
            backend = get_attention_backend(name, 9, 3, 64)
            outputs.append(backend.forward(q, k, v, tuple(c.clone() for c in cache), backend.prepare(layout)))
        assert outputs[1].dtype == torch.float32
        if native_bfloat16 and cache_dtype == torch.float16:  # q, K and V rounded to 8 significant bits
            assert not torch.equal(outputs[1], outputs[0])
            assert (outputs[1] - outputs[0]).norm() / outputs[0].norm() < 0.01
        else:
            assert torch.equal(outputs[1], outputs[0])


@pytest.mark.slow
def test_the_default_model_with_the_cpu_backend_matches_transformers_greedy():
    engine = LLMEngine(EngineConfig(model="smollm2-135m", attention_backend="cpu"))
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):")]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    reference = load_reference(engine.model_path)
    for prompt, out in zip(prompts, outputs):
        expected, _ = reference_greedy(reference, prompt, 24)
        assert out.token_ids == expected
