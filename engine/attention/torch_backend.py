"""Attention over the paged KV cache with torch's scaled_dot_product_attention.

Each sequence's context is gathered from the cache through its block table into a padded
[batch, kv_heads, max_context, head_dim] view; a boolean mask hides padding and the future.
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

from engine.attention.backend import AttentionBackend, BatchLayout


@dataclass
class _PaddedGroup:
    kv_slots: torch.Tensor  # [B, Lk] flat cache slot of each context position (0 where padded)
    mask: torch.Tensor  # [B, 1, group * Lq, Lk] True where a query may attend
    query_index: torch.Tensor | None = None  # [B, Lq] flat token index of each query (prefill)
    query_valid: torch.Tensor | None = None  # [B, Lq] False on padding rows (prefill)


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
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, metadata.slot_mapping, key)
        v_flat.index_copy_(0, metadata.slot_mapping, value)
        nd = metadata.num_decodes
        if metadata.prefill is None:
            return self._decode(query, k_flat, v_flat, metadata.decode)
        output = torch.empty_like(query)
        if metadata.decode is not None:
            output[:nd] = self._decode(query[:nd], k_flat, v_flat, metadata.decode)
        output[nd:] = self._prefill(query, k_flat, v_flat, metadata.prefill)
        return output

    def _decode(self, query, k_flat, v_flat, group: _PaddedGroup) -> torch.Tensor:
        num_seqs = query.shape[0]
        q = query.view(num_seqs, self.num_kv_heads, -1, self.head_dim)
        out = self._attend(q, k_flat, v_flat, group)
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, query, k_flat, v_flat, group: _PaddedGroup) -> torch.Tensor:
        num_seqs, max_q = group.query_index.shape
        q = query[group.query_index].transpose(1, 2)  # [B, H, Lq, D]
        q = q.reshape(num_seqs, self.num_kv_heads, -1, self.head_dim)
        out = self._attend(q, k_flat, v_flat, group)
        out = out.view(num_seqs, self.num_heads, max_q, self.head_dim).transpose(1, 2)
        return out[group.query_valid]

    def _attend(self, q, k_flat, v_flat, group: _PaddedGroup) -> torch.Tensor:
        k = k_flat[group.kv_slots].transpose(1, 2)  # [B, kv_heads, Lk, D]
        v = v_flat[group.kv_slots].transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale)

    @staticmethod
    def _kv_slots(block_tables, context_lens, block_size, device) -> torch.Tensor:
        max_context = max(context_lens)
        max_blocks = -(-max_context // block_size)
        padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in block_tables]
        table = torch.tensor(padded, dtype=torch.long, device=device)
        positions = torch.arange(max_context, device=device)
        return table[:, positions // block_size] * block_size + positions % block_size

    def _decode_group(self, block_tables, context_lens, block_size, device) -> _PaddedGroup:
        kv_slots = self._kv_slots(block_tables, context_lens, block_size, device)
        context = torch.tensor(context_lens, device=device)
        positions = torch.arange(kv_slots.shape[1], device=device)
        mask = (positions[None, :] < context[:, None])[:, None, None, :]
        return _PaddedGroup(kv_slots, mask)

    def _prefill_group(self, layout: BatchLayout, device) -> _PaddedGroup:
        nd = layout.num_decodes
        query_lens = torch.tensor(layout.query_lens[nd:], device=device)
        context = torch.tensor(layout.context_lens[nd:], device=device)
        query_start = torch.cumsum(query_lens, 0) - query_lens + nd
        kv_slots = self._kv_slots(layout.block_tables[nd:], layout.context_lens[nd:], layout.block_size, device)
        rows = torch.arange(int(query_lens.max()), device=device)
        query_valid = rows[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, query_start[:, None] + rows[None, :], 0)
        query_pos = (context - query_lens)[:, None] + rows[None, :]
        key_pos = torch.arange(kv_slots.shape[1], device=device)
        causal = key_pos[None, None, :] <= query_pos[:, :, None]
        # Padding rows attend to position 0 only, so softmax never sees an all-masked row.
        mask = torch.where(query_valid[:, :, None], causal, key_pos[None, None, :] == 0)
        group_size = self.num_heads // self.num_kv_heads
        mask = mask[:, None].repeat(1, 1, group_size, 1)
        return _PaddedGroup(kv_slots, mask, query_index, query_valid)
