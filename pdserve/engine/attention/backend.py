"""The attention backend interface and the flat batch layout every backend reads.

A step's batch is flat: the tokens of every scheduled sequence, one after another, decodes
(one query token each) first, then prefill chunks:

    tokens:   [d0][d1][d2][p0 p0 p0 p0][p1 p1]
    seq:        0   1   2   3            4
    query_start_loc = [0, 1, 2, 3, 7, 9]     context_lens = positions of the last query + 1

A backend builds its metadata once per step (`prepare`) and reuses it in every layer
(`forward`), so no per-layer Python work depends on the number of sequences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """Per-step description of the flat batch (all tensors on the model's device)."""

    query_lens: list[int]
    context_lens: list[int]  # tokens of KV each sequence attends to, this step's included
    block_tables: list[list[int]]
    num_decodes: int  # the first num_decodes sequences have query length 1
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot (block_id * block_size + offset) per token
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def padded_block_tables(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> list[list[int]]:
    """Each sequence's blocks up to the longest context's count, cut or padded with block 0."""
    max_blocks = -(-max(context_lens) // block_size)
    return [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in block_tables]


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context.

    Cache layout per layer: K and V of shape [num_blocks, block_size, num_kv_heads, head_dim].
    `forward` mutates the layer's cache (the new tokens' K/V) and nothing else.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> object:
        """Builds the per-step metadata shared by every layer."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: object,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Stores key/value at the layout's slots, then returns attention output per token."""
