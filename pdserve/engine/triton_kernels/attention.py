"""Triton kernels over the paged KV cache: the KV write, decode attention and prefill/extend attention.

Cache layout (per layer, as every backend): K and V of shape [num_blocks, block_size,
num_kv_heads, head_dim], contiguous, so token slot `s` of KV head `h` starts at element
`(s * num_kv_heads + h) * head_dim`. Every kernel walks a sequence's block table and reads
pages where they lie: nothing gathers a context.

  store_kv:          one program per token copies its new K/V rows to their slot;
                     slot -1 is a padding token (CUDA-graph batches) and writes nothing.
  decode attention:  split-K. One program per (sequence, KV head, split) attends every query
                     head of the KV head's group (GQA: the group shares each page it loads) over
                     one slice of the context, keeping a running max and sum (online softmax);
                     a second kernel merges the slices. Long contexts fill the GPU with splits
                     even at batch 1.
  extend attention:  one program per (sequence, query head, tile of query rows) over the cached
                     prefix plus the chunk's own tokens (already written by store_kv), causal,
                     varlen: sequences are located by `query_start_loc`.

Softmax and accumulators are float32 whatever the cache dtype. `IEEE` (float32 models) keeps
tl.dot from using TF32, so float32 results stay close to torch's. Triton's interpreter (the
CPU tests) computes tl.dot wrongly on bfloat16 tiles, so there the extend kernel multiplies in
float32 for every dtype; bfloat16 tiles meet tensor cores only on the GPU (make gpu-check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_TOKENS = 256  # context tokens one decode program covers (a multiple of every block size used)
EXTEND_BLOCK_M = 16  # query rows per extend program


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    num_kv_heads, head_dim,
    HEADS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < tl.where(slot >= 0, head_dim, 0))  # a padding token masks everything
    k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + h * value_stride_h + d, mask=mask)
    dst = (slot * num_kv_heads + h) * head_dim + d
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] (any row strides) at their slots;
    one program per token writes all its KV heads."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_kv_heads, head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr,
    scale, q_stride_t, q_stride_h, block_table_stride, num_kv_heads, head_dim, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q_offsets = seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    start = split * SPLIT
    end = tl.minimum(context_len, start + SPLIT)
    offsets = tl.arange(0, PAGE)
    for page_start in range(start, end, PAGE):
        block = tl.load(block_table_ptr + seq * block_table_stride + page_start // PAGE).to(tl.int64)
        valid = page_start + offsets < context_len
        rows = (block * PAGE + offsets)[:, None] * num_kv_heads + kv_head
        kv_offsets = rows * head_dim + d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, PAGE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    num_heads = num_kv_heads * GROUP
    part = (seq * num_heads + heads) * num_splits + split  # [GROUP_PAD]
    tl.store(part_max_ptr + part, running_max, mask=g_mask)
    tl.store(part_sum_ptr + part, running_sum, mask=g_mask)
    tl.store(part_out_ptr + part[:, None] * head_dim + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    out_stride_t, out_stride_h, head_dim, num_splits,
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    part = (seq * num_heads + head) * num_splits + s
    maxes = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    out_mask = s_mask[:, None] & d_mask[None, :]
    outs = tl.load(part_out_ptr + part[:, None] * head_dim + d[None, :], mask=out_mask, other=0.0)
    # Splits past the context hold max -inf, sum 0: their weight is exp(-inf) = 0.
    weights = tl.exp(maxes - tl.max(maxes, axis=0))
    out = tl.sum(outs * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(query, k_cache, v_cache, block_table, context_lens, scale, num_splits, out=None):
    """Attention of one query token per sequence over its paged context.

    query [num_seqs, num_heads, head_dim]; block_table [num_seqs, max_blocks] int32; context_lens
    [num_seqs] int32 (tokens of KV, this step's included). `num_splits` slices of SPLIT_TOKENS
    cover the longest context (a host-side number: nothing here syncs with the device).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    parts = (num_seqs, num_heads, num_splits)
    part_out = torch.empty((*parts, head_dim), dtype=torch.float32, device=query.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_table, context_lens,
        part_out, part_max, part_sum,
        scale, query.stride(0), query.stride(1), block_table.stride(0), num_kv_heads, head_dim, num_splits,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_D=block_d, PAGE=page, SPLIT=SPLIT_TOKENS,
    )  # fmt: skip
    _decode_merge_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum,
        out.stride(0), out.stride(1), head_dim, num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def num_decode_splits(max_context_len: int) -> int:
    return max(1, -(-max_context_len // SPLIT_TOKENS))


@triton.jit
def _extend_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr, query_start_ptr,
    scale, q_stride_t, q_stride_h, out_stride_t, out_stride_h, block_table_stride, num_kv_heads, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // GROUP
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    context_len = tl.load(context_lens_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len
    positions = context_len - query_len + rows  # of each query row in its sequence
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_offsets = (query_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to this tile's last query position (causal); an empty tile reads none.
    last_row = tl.minimum(query_len, (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < query_len, context_len - query_len + last_row, 0)
    offsets = tl.arange(0, PAGE)
    for page_start in range(0, kv_end, PAGE):
        block = tl.load(block_table_ptr + seq * block_table_stride + page_start // PAGE).to(tl.int64)
        key_positions = page_start + offsets
        rows_in_cache = (block * PAGE + offsets)[:, None] * num_kv_heads + kv_head
        kv_offsets = rows_in_cache * head_dim + d[None, :]
        kv_mask = (key_positions < kv_end)[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = (key_positions[None, :] <= positions[:, None]) & row_valid[:, None]
        scores = tl.where(visible, scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that see no key yet
        alpha = tl.exp(running_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * alpha + tl.sum(probs, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = new_max

    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    out_offsets = (query_start + rows)[:, None] * out_stride_t + head * out_stride_h + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def extend_attention(query, k_cache, v_cache, block_table, context_lens, query_start_loc, max_query_len, scale, out):
    """Causal attention of prefill chunks over their cached prefix and themselves.

    query [num_tokens, num_heads, head_dim] holds the chunks back to back; sequence i's rows are
    query_start_loc[i]:query_start_loc[i + 1] (int32, num_seqs + 1 entries), at the last
    rows of its context_lens[i] positions. Their K/V must already be in the cache. Writes `out`.
    """
    num_seqs = block_table.shape[0]
    _, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    assert page >= 16, "tl.dot needs tiles of at least 16 keys: use --block-size 16 or more"
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, EXTEND_BLOCK_M))
    _extend_kernel[grid](
        query, out, k_cache, v_cache, block_table, context_lens, query_start_loc,
        scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        num_kv_heads, head_dim,
        GROUP=num_heads // num_kv_heads, BLOCK_M=EXTEND_BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page, IEEE=query.dtype == torch.float32 or triton.knobs.runtime.interpret,
    )  # fmt: skip
    return out
