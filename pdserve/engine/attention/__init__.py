"""Attention backends over the paged KV cache, chosen by name.

The factory lives here, so `backend.py` (the interface) knows no implementation."""

from pdserve.engine.attention.backend import AttentionBackend, BatchLayout
from pdserve.engine.attention.cpu_backend import CpuAttentionBackend
from pdserve.engine.attention.torch_backend import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}

__all__ = ["BACKENDS", "AttentionBackend", "BatchLayout", "get_attention_backend"]


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name](num_heads, num_kv_heads, head_dim)
