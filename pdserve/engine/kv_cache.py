"""Per-layer paged KV storage.

Layout per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim]; token t of a
sequence lives at slot block_table[t // block_size] * block_size + t % block_size of the
flattened [num_blocks * block_size, num_kv_heads, head_dim] view.

All layers live in one tensor [num_layers, 2 (K, V), num_blocks, ...] and the per-layer K/V
are views of it, so a run of blocks can be copied for every layer at once (`stacked_view`).

Where that tensor lives is the caller's choice (`KvCacheStorage`): local memory by default; a
decode node puts it in a shared-memory segment that same-host prefill nodes write into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.huge_pages import empty_on_huge_pages


@dataclass(frozen=True)
class KvCacheSpec:
    """The shape of a paged KV cache: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str = "cpu"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class KvCacheStorage(Protocol):
    """Where an engine's KV cache lives; the engine's caller picks it at construction."""

    def allocate(self, spec: KvCacheSpec) -> torch.Tensor:
        """A zeroed tensor of `spec.shape`, `spec.dtype` on `spec.device`; the engine owns its contents."""
        ...


class LocalKvCacheStorage:
    """The default: the cache in this process's memory (or on its device)."""

    def allocate(self, spec: KvCacheSpec) -> torch.Tensor:
        if torch.device(spec.device).type != "cpu":
            return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
        # A step reads its sequences' blocks wherever they lie: huge pages spare the TLB misses.
        # Written once now, as torch.zeros did: the cache's memory is taken (and backed by huge
        # pages) at start-up, not at the first write to each page in the middle of serving.
        return empty_on_huge_pages(spec.shape, spec.dtype).zero_()


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    spec = KvCacheSpec(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    return kv_caches_over(LocalKvCacheStorage().allocate(spec))


def kv_caches_over(stacked: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) views of a [num_layers, 2, num_blocks, ...] tensor."""
    return [(stacked[layer, 0], stacked[layer, 1]) for layer in range(stacked.shape[0])]


def stacked_view(kv_caches) -> torch.Tensor | None:
    """The [num_layers, 2, num_blocks, ...] tensor the per-layer caches are views of, or None
    if they are separate allocations."""
    k0 = kv_caches[0][0]
    layer_stride = (
        kv_caches[1][0].data_ptr() - k0.data_ptr() if len(kv_caches) > 1 else 2 * k0.numel() * k0.element_size()
    )
    kind_stride = kv_caches[0][1].data_ptr() - k0.data_ptr()
    size = k0.element_size()
    for layer, (k, v) in enumerate(kv_caches):
        if k.data_ptr() != k0.data_ptr() + layer * layer_stride or v.data_ptr() != k.data_ptr() + kind_stride:
            return None
    if layer_stride % size or kind_stride % size or not k0.is_contiguous():
        return None
    shape = (len(kv_caches), 2, *k0.shape)
    strides = (layer_stride // size, kind_stride // size, *k0.stride())
    return torch.as_strided(k0, shape, strides)
