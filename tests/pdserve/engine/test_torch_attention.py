"""The torch attention backend against attention written out per sequence and per query: both
prefill paths (a causal chunk with no cached prefix, with SDPA's own mask; a chunk after a
cached prefix, with an explicit mask), one prefill sequence or several of different lengths,
alone or behind decodes."""

from __future__ import annotations

import pytest
import torch

from tests.pdserve.engine.test_triton_kernels import paged_batch, run_backend


def reference_attention(layout, q, cache, num_heads, num_kv_heads):
    """Each query row attends to its own sequence's positions up to its own, read from the cache
    that the backend wrote this step's keys and values into."""
    k_cache, v_cache = cache
    block_size, group, scale = layout.block_size, num_heads // num_kv_heads, q.shape[-1] ** -0.5
    outputs, row = [], 0
    for table, context, length in zip(layout.block_tables, layout.context_lens, layout.query_lens):
        positions = torch.arange(context)
        blocks = torch.tensor(table)[positions // block_size]
        keys = k_cache[blocks, positions % block_size].repeat_interleave(group, dim=1)  # [context, H, D]
        values = v_cache[blocks, positions % block_size].repeat_interleave(group, dim=1)
        for i in range(length):
            visible = context - length + i + 1
            scores = torch.einsum("hd,thd->ht", q[row + i], keys[:visible]) * scale
            outputs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values[:visible]))
        row += length
    return torch.stack(outputs)


@pytest.mark.parametrize(
    ("decode_lens", "prefills"),
    [
        ([], [(0, 37)]),  # one prompt, no cached prefix: the causal path, no gather of its rows
        ([], [(0, 5), (0, 33), (0, 16)]),  # several prompts of different lengths: padding rows dropped
        ([], [(16, 20)]),  # after a cached prefix: the masked path
        ([9, 1], [(0, 21)]),  # decodes, then one prompt
        ([17, 300], [(0, 9), (32, 18), (5, 3)]),  # decodes, then prompts with and without a prefix
    ],
)
def test_the_torch_backend_attends_as_written_out(decode_lens, prefills):
    num_heads, num_kv_heads = 9, 3
    layout, qkv, cache = paged_batch(decode_lens, prefills, num_heads, num_kv_heads)
    out, written = run_backend("torch", layout, qkv, cache, num_heads, num_kv_heads, 64)
    want = reference_attention(layout, qkv[0], written, num_heads, num_kv_heads)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
