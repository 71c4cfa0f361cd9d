"""Attention backends over the paged KV cache, chosen by name."""

from pdserve.engine.attention.backend import AttentionBackend, BatchLayout, get_attention_backend

__all__ = ["AttentionBackend", "BatchLayout", "get_attention_backend"]
