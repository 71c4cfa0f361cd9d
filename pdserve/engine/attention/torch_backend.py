"""Attention over the paged KV cache with torch's scaled_dot_product_attention.

Each sequence's context is gathered from the cache block by block (whole blocks: one index
per block, not per token) into a padded [batch, max_blocks * block_size, kv_heads, head_dim]
tensor; a boolean mask hides padding, the unwritten tail of the last block and the future.
Decodes (one query each) and prefill chunks are two padded groups, so a long prefill chunk
does not pad every decode to its length.

GQA without copying K/V: query heads that share a KV head are folded into the query length,

    q [B, H, Lq, D] -> [B, kv_heads, group * Lq, D]     (head h uses kv head h // group)

so one SDPA call attends every group to its own KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.backend import AttentionBackend, BatchLayout, padded_block_tables


@dataclass
class _PaddedGroup:
    block_table: torch.Tensor  # [B, max_blocks] block ids (0 where padded; masked out)
    mask: torch.Tensor | None  # [B, 1, group * Lq, Lk] True where a query may attend (None: causal)
    query_index: torch.Tensor | None = None  # [B, Lq] flat token index of each query (prefill)
    query_valid: torch.Tensor | None = None  # [B, Lq] False on padding rows (prefill)
    context_lens: torch.Tensor | None = None  # [B] (decode, for backends that read blocks in place)
    # Prefill chunks with no cached prefix (context == query length): SDPA's own causal mask over the
    # first Lq keys, with no mask tensor, no GQA fold and the masked half skipped (`mask` is None).
    causal: bool = False


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode: _PaddedGroup | None
    prefill: _PaddedGroup | None


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout) -> TorchAttentionMetadata:
        device = layout.slot_mapping.device
        nd = layout.num_decodes
        decode = prefill = None
        if nd:
            decode = self._decode_group(layout.block_tables[:nd], layout.context_lens[:nd], layout.block_size, device)
        if layout.num_seqs > nd:
            prefill = self._prefill_group(layout, device)
        return TorchAttentionMetadata(layout.slot_mapping, nd, decode, prefill)

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        # A 16-bit cache under float32 activations (--kv-cache-dtype) stores K and V rounded.
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, metadata.slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
            0, metadata.slot_mapping, value.to(v_cache.dtype)
        )
        nd = metadata.num_decodes
        if metadata.prefill is None:
            return self._decode(query, k_cache, v_cache, metadata.decode)
        output = torch.empty_like(query)
        if metadata.decode is not None:
            output[:nd] = self._decode(query[:nd], k_cache, v_cache, metadata.decode)
        output[nd:] = self._prefill(query, k_cache, v_cache, metadata.prefill)
        return output

    def _decode(self, query, k_cache, v_cache, group: _PaddedGroup) -> torch.Tensor:
        num_seqs = query.shape[0]
        q = query.reshape(num_seqs, self.num_kv_heads, -1, self.head_dim)
        out = self._attend(q, k_cache, v_cache, group)
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, query, k_cache, v_cache, group: _PaddedGroup) -> torch.Tensor:
        num_seqs, max_q = group.query_index.shape
        if num_seqs == 1:  # the common case: its rows are the batch's last ones, no gather needed
            q = query[query.shape[0] - max_q :].transpose(0, 1).unsqueeze(0)
        else:
            q = query[group.query_index].transpose(1, 2)  # [B, H, Lq, D]
        if group.causal:
            k = self._gather(k_cache, group.block_table, q.dtype)[:, :, :max_q]
            v = self._gather(v_cache, group.block_table, q.dtype)[:, :, :max_q]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            out = self._attend(q.reshape(num_seqs, self.num_kv_heads, -1, self.head_dim), k_cache, v_cache, group)
        out = out.view(num_seqs, self.num_heads, max_q, self.head_dim).transpose(1, 2)
        return out[0] if num_seqs == 1 else out[group.query_valid]

    def _attend(self, q, k_cache, v_cache, group: _PaddedGroup) -> torch.Tensor:
        k = self._gather(k_cache, group.block_table, q.dtype)
        v = self._gather(v_cache, group.block_table, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, kv_heads, max_blocks * block_size, D] context of each sequence, in `dtype` (index_select on
        a flat id list is about twice as fast as advanced indexing with a 2-D table on CPU)."""
        num_seqs = block_table.shape[0]
        blocks = cache.index_select(0, block_table.flatten()).to(dtype)
        return blocks.view(num_seqs, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    @staticmethod
    def _block_table(block_tables, context_lens, block_size, device) -> torch.Tensor:
        return torch.tensor(
            padded_block_tables(block_tables, context_lens, block_size), dtype=torch.long, device=device
        )

    def _decode_group(self, block_tables, context_lens, block_size, device) -> _PaddedGroup:
        block_table = self._block_table(block_tables, context_lens, block_size, device)
        context = torch.tensor(context_lens, device=device)
        positions = torch.arange(block_table.shape[1] * block_size, device=device)
        mask = (positions[None, :] < context[:, None])[:, None, None, :]
        return _PaddedGroup(block_table, mask, context_lens=context)

    def _prefill_group(self, layout: BatchLayout, device) -> _PaddedGroup:
        nd = layout.num_decodes
        query_lens = torch.tensor(layout.query_lens[nd:], device=device)
        query_start = torch.cumsum(query_lens, 0) - query_lens + nd
        block_table = self._block_table(layout.block_tables[nd:], layout.context_lens[nd:], layout.block_size, device)
        rows = torch.arange(int(query_lens.max()), device=device)
        query_valid = rows[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, query_start[:, None] + rows[None, :], 0)
        if layout.query_lens[nd:] == layout.context_lens[nd:]:
            # Padding rows (past a shorter sequence's end) see only that sequence's own keys or
            # padding, and are dropped.
            return _PaddedGroup(block_table, None, query_index, query_valid, causal=True)
        context = torch.tensor(layout.context_lens[nd:], device=device)
        query_pos = (context - query_lens)[:, None] + rows[None, :]
        key_pos = torch.arange(block_table.shape[1] * layout.block_size, device=device)
        causal = key_pos[None, None, :] <= query_pos[:, :, None]
        # Padding rows attend to position 0 only, so softmax never sees an all-masked row.
        mask = torch.where(query_valid[:, :, None], causal, key_pos[None, None, :] == 0)
        group_size = self.num_heads // self.num_kv_heads
        mask = mask[:, None].repeat(1, 1, group_size, 1)
        return _PaddedGroup(block_table, mask, query_index, query_valid)
