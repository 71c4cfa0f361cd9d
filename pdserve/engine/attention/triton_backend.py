"""Attention with Triton kernels over the paged KV cache (`--attention-backend triton`), for GPU nodes.

Per step, `prepare` turns the layout into small int32 tensors (block tables, context lengths,
where each prefill chunk's rows start) and the host-side numbers the launches need (decode
splits, the longest chunk), so no layer waits on the device. Per layer, `forward` writes the
new K/V at their slots, then runs the split-K decode kernel on the decode rows and the
extend kernel on the prefill rows (pdserve/engine/triton_kernels/attention.py).

On CPU tensors the kernels only run under Triton's interpreter (TRITON_INTERPRET=1), which
the tests use; a node asked for this backend on CPU otherwise refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBackend, BatchLayout
from pdserve.engine.triton_kernels import attention as kernels


@dataclass
class DecodeGroup:
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor  # [num_decodes] int32
    num_splits: int


@dataclass
class PrefillGroup:
    block_table: torch.Tensor  # [num_prefills, max_blocks] int32
    context_lens: torch.Tensor  # [num_prefills] int32
    query_start_loc: torch.Tensor  # [num_prefills + 1] int32, rows counted from the first prefill row
    max_query_len: int


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode: DecodeGroup | None
    prefill: PrefillGroup | None


class TritonAttentionBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout) -> TritonAttentionMetadata:
        device = layout.slot_mapping.device
        nd = layout.num_decodes
        decode = prefill = None
        if nd:
            decode = DecodeGroup(
                _block_table(layout.block_tables[:nd], device),
                torch.tensor(layout.context_lens[:nd], dtype=torch.int32, device=device),
                kernels.num_decode_splits(max(layout.context_lens[:nd])),
            )
        if layout.num_seqs > nd:
            query_lens = layout.query_lens[nd:]
            starts = [0]
            for length in query_lens:
                starts.append(starts[-1] + length)
            prefill = PrefillGroup(
                _block_table(layout.block_tables[nd:], device),
                torch.tensor(layout.context_lens[nd:], dtype=torch.int32, device=device),
                torch.tensor(starts, dtype=torch.int32, device=device),
                max(query_lens),
            )
        return TritonAttentionMetadata(layout.slot_mapping, nd, decode, prefill)

    def forward(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        kernels.store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = metadata.num_decodes
        if metadata.decode is not None:
            group = metadata.decode
            kernels.paged_decode_attention(
                query[:nd], k_cache, v_cache, group.block_table, group.context_lens, self.scale, group.num_splits,
                out=output[:nd],
            )  # fmt: skip
        if metadata.prefill is not None:
            group = metadata.prefill
            kernels.extend_attention(
                query[nd:], k_cache, v_cache, group.block_table, group.context_lens, group.query_start_loc,
                group.max_query_len, self.scale, out=output[nd:],
            )  # fmt: skip
        return output


def _block_table(block_tables: list[list[int]], device) -> torch.Tensor:
    """Block ids padded with 0 to the longest table (the kernels never read past a context)."""
    width = max(len(table) for table in block_tables)
    padded = [table + [0] * (width - len(table)) for table in block_tables]
    return torch.tensor(padded, dtype=torch.int32, device=device)
