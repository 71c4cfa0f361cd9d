"""The Triton kernels against the torch backend and torch ops, on small shapes: on CPU under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no GPU is present), on
the GPU as they are when one is.

Shapes cover block-boundary lengths, the decode kernel's split edges, GQA ratios (including
multi-query), mixed decode + prefill batches, and prefill chunks after a cached prefix that
ends inside a block."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.attention import BatchLayout, get_attention_backend
from pdserve.engine.models.llama import RMSNorm, apply_rotary
from pdserve.engine.triton_kernels import attention as kernels
from pdserve.engine.triton_kernels import elementwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_batch(
    decode_lens: list[int],
    prefills: list[tuple[int, int]],  # (cached prefix, chunk length)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A cache filled with random K/V, scattered block tables, and this step's q/k/v: one token
    per decode, then each prefill chunk at the end of its context."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    context_lens = decode_lens + [prefix + chunk for prefix, chunk in prefills]
    query_lens = [1] * len(decode_lens) + [chunk for _, chunk in prefills]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = (torch.randn(shape, dtype=dtype, device=DEVICE), torch.randn(shape, dtype=dtype, device=DEVICE))
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, n, q in zip(tables, context_lens, query_lens)
        for p in range(n - q, n)
    ]
    layout = BatchLayout(
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        num_decodes=len(decode_lens),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_size=block_size,
    )
    num_tokens = sum(query_lens)
    heads = (num_heads, num_kv_heads, num_kv_heads)
    qkv = [torch.randn(num_tokens, n, head_dim, dtype=dtype, device=DEVICE) for n in heads]
    return layout, qkv, cache


def run_backend(name: str, layout, qkv, cache, num_heads: int, num_kv_heads: int, head_dim: int):
    backend = get_attention_backend(name, num_heads, num_kv_heads, head_dim)
    cache = tuple(c.clone() for c in cache)
    return backend.forward(*qkv, cache, backend.prepare(layout)), cache


def assert_triton_matches_torch(layout, qkv, cache, num_heads, num_kv_heads, head_dim, tol=2e-5):
    want, want_cache = run_backend("torch", layout, qkv, cache, num_heads, num_kv_heads, head_dim)
    got, got_cache = run_backend("triton", layout, qkv, cache, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for got_layer, want_layer in zip(got_cache, want_cache):
        assert torch.equal(got_layer, want_layer)  # the KV write is a copy: bit for bit


@pytest.mark.parametrize(
    ("decode_lens", "num_heads", "num_kv_heads", "head_dim"),
    [
        ([1], 4, 4, 64),  # one token of context
        ([15, 16, 17, 32, 33], 9, 3, 64),  # block boundaries; the default model's GQA ratio
        ([255, 256, 257, 513], 8, 2, 64),  # the split edges (256 tokens a split)
        ([700, 3], 8, 1, 64),  # multi-query, a long and a short context in one batch
        ([40, 9], 4, 2, 48),  # a head size that is not a power of two
    ],
)
def test_paged_decode_attention_matches_the_torch_backend(decode_lens, num_heads, num_kv_heads, head_dim):
    layout, qkv, cache = paged_batch(decode_lens, [], num_heads, num_kv_heads, head_dim)
    assert_triton_matches_torch(layout, qkv, cache, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize(
    ("prefills", "num_heads", "num_kv_heads"),
    [
        ([(0, 5)], 4, 4),  # a short prompt, one partial block
        ([(0, 16), (0, 17), (0, 33)], 9, 3),  # chunks at block boundaries, rows past one query tile
        ([(16, 20), (7, 30)], 8, 2),  # prefix-cache hits: a whole cached block, and a prefix ending mid-block
        ([(40, 2)], 8, 1),  # a two-token chunk after a long prefix, multi-query
    ],
)
def test_extend_attention_matches_the_torch_backend(prefills, num_heads, num_kv_heads):
    layout, qkv, cache = paged_batch([], prefills, num_heads, num_kv_heads)
    assert_triton_matches_torch(layout, qkv, cache, num_heads, num_kv_heads, 64)


def test_a_mixed_batch_of_decodes_and_prefill_chunks_matches_the_torch_backend():
    layout, qkv, cache = paged_batch([17, 1, 300], [(0, 9), (32, 18), (5, 3)], 6, 2)
    assert_triton_matches_torch(layout, qkv, cache, 6, 2, 64)


def test_bfloat16_attention_stays_close_to_the_torch_backend():
    layout, qkv, cache = paged_batch([30, 270], [(16, 21)], 8, 2, dtype=torch.bfloat16)
    assert_triton_matches_torch(layout, qkv, cache, 8, 2, 64, tol=2e-2)


def test_store_kv_skips_padding_slots_and_reads_strided_rows():
    num_kv_heads, head_dim = 2, 64
    fused = torch.randn(5, 3 * num_kv_heads, head_dim, device=DEVICE)  # k and v are views into one tensor
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    k_cache = torch.zeros(4, 16, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, -1, 17, 63, -1], device=DEVICE)
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[row]) and torch.equal(flat_v[slot], value[row])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 3  # padding wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_model_norm(dtype, with_residual):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(device=DEVICE, dtype=dtype)
    norm.weight.data = torch.randn(96, device=DEVICE, dtype=dtype)
    x = torch.randn(7, 96, device=DEVICE, dtype=dtype)
    residual = torch.randn(7, 96, device=DEVICE, dtype=dtype) if with_residual else None
    summed = x + residual if with_residual else x
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = elementwise.rms_norm(x, norm.weight, norm.eps, residual)
    if with_residual:
        got, got_sum = got
        # float32: bit for bit; bfloat16 within a rounding step (the interpreter truncates casts)
        torch.testing.assert_close(got_sum, summed, rtol=0 if dtype == torch.float32 else tol, atol=0)
    torch.testing.assert_close(got, norm(summed), rtol=tol, atol=tol)


def test_rotary_matches_the_model_rotary():
    from transformers import LlamaConfig

    from pdserve.engine.models.llama import rotary_tables

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=128, rope_theta=10000.0)
    cos, sin = (t.to(DEVICE) for t in rotary_tables(config))
    qk = torch.randn(6, 7, 64, device=DEVICE)  # 4 query + 3 key heads, rotated together as the model does
    positions = torch.tensor([0, 1, 5, 64, 100, 127], device=DEVICE)
    want = apply_rotary(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    strided = torch.randn(6, 9, 64, device=DEVICE)[:, :7]  # a view of the fused qkv rows
    strided.copy_(qk)
    got = elementwise.apply_rotary(strided, positions, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_triton_backend_refuses_to_serve_on_cpu_and_small_blocks(monkeypatch):
    from pdserve.engine.model_runner import check_backend_fits_device

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA"):
        check_backend_fits_device("triton", torch.device("cpu"), 16)
    check_backend_fits_device("torch", torch.device("cpu"), 16)
    with pytest.raises(ValueError, match="--block-size 16 or more"):
        check_backend_fits_device("triton", torch.device("cuda"), 8)


def test_gpu_memory_utilization_is_a_share():
    from pdserve.engine import CacheConfig

    assert CacheConfig(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
