"""Attention backends over the paged KV cache, chosen by name.

The factory lives here, so `backend.py` (the interface) knows no implementation. The triton
backend is imported only when chosen: triton is a heavy import that CPU nodes do without.
"""

from pdserve.engine.attention.backend import AttentionBackend, BatchLayout
from pdserve.engine.attention.cpu_backend import CpuAttentionBackend
from pdserve.engine.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("torch", "cpu", "triton")

__all__ = ["BACKENDS", "AttentionBackend", "BatchLayout", "get_attention_backend"]


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "cpu":
        return CpuAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
