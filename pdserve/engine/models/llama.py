"""Llama-family decoder (Llama, Qwen2) over a flat token batch and a paged KV cache.

Computes exactly what transformers computes (RMSNorm in float32, rotary tables from
transformers' own rotary module, SiLU-gated MLP), with q/k/v and gate/up projections fused
into one matmul each to keep the number of kernels per layer small.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pdserve.engine.attention import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = None  # the C++ norm, where the CPU kernels run this model (cpu_decode.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.kernel is not None:
                return self.kernel(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps).view(x.shape)
            # One fused kernel instead of seven, bit for bit the same as below in float32
            # (tests/pdserve/engine/test_llama_model.py); other dtypes keep transformers' upcast.
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, bit for bit: rotate_half negates the
    first half of the swapped halves, and here that sign lives in `signed_sin` instead."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        o_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.backend = backend

    def forward(self, x, rotate, kv_cache, attn_metadata) -> torch.Tensor:
        """`rotate(qk)`: the rotary embedding of this step's positions, applied to q and k heads."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k heads together: one set of elementwise kernels instead of two.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = rotate(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.activation_kernel = None  # C++ silu(gate) * up, where the CPU kernels run this model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation_kernel is not None and gate_up.dtype == torch.float32:
            rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
            return self.down_proj(self.activation_kernel(rows).view(*gate_up.shape[:-1], self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rotate, kv_cache, attn_metadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotate, kv_cache, attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Mutates nothing but the KV caches passed to `forward`.

    `triton_ops` (set with the triton attention backend): norms and rotary run as Triton
    kernels, each norm fused with the residual add before it.
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rotary_tables(config)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        self.triton_ops = False

    def forward(self, input_ids, positions, kv_caches, attn_metadata, after_layer=None) -> torch.Tensor:
        """Hidden states of every token: [num_tokens, hidden_size]. `after_layer(i)` runs once
        layer i's K/V are in the cache (a prefill node pushes them while later layers run)."""
        if self.triton_ops:
            return self._forward_triton(input_ids, positions, kv_caches, attn_metadata, after_layer)
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        rotate = functools.partial(apply_rotary, cos=cos, signed_sin=sin)
        x = self.embed_tokens(input_ids)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rotate, kv_cache, attn_metadata)
            if after_layer is not None:
                after_layer(index)
        return self.norm(x)

    def _forward_triton(self, input_ids, positions, kv_caches, attn_metadata, after_layer) -> torch.Tensor:
        """`forward` with Triton's norms and rotary: the residual stream is carried beside the
        layer outputs and added inside the next norm, so each add costs no pass of its own."""
        from pdserve.engine.triton_kernels import elementwise

        rotate = functools.partial(
            elementwise.apply_rotary, positions=positions, cos_table=self.cos_table, signed_sin_table=self.sin_table
        )
        x, residual = self.embed_tokens(input_ids), None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            norm = layer.input_layernorm
            if residual is None:
                h, residual = elementwise.rms_norm(x, norm.weight, norm.eps), x
            else:
                h, residual = elementwise.rms_norm(x, norm.weight, norm.eps, residual)
            x = layer.self_attn(h, rotate, kv_cache, attn_metadata)
            norm = layer.post_attention_layernorm
            h, residual = elementwise.rms_norm(x, norm.weight, norm.eps, residual)
            x = layer.mlp(h)
            if after_layer is not None:
                after_layer(index)
        return elementwise.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def rotary_tables(config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (see `apply_rotary`) for every position, from transformers' own
    rotary module (float32): the same values it uses, whatever the rope type."""
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(config.max_position_embeddings)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(dummy, positions)
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    return cos[0], signed_sin


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_weights(model: LlamaModel, hf_tensors: dict[str, torch.Tensor]) -> None:
    """Copies a transformers state dict (names like `model.layers.0.self_attn.q_proj.weight`)
    into the fused modules. Raises ValueError naming any missing or unexpected tensor."""
    pieces: dict[str, list[torch.Tensor | None]] = {}
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in hf_tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("rotary_emb."):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, index = _FUSED[parts[-2]]
            key = ".".join(parts[:-2] + [fused, parts[-1]])
            pieces.setdefault(key, [None] * (3 if fused == "qkv_proj" else 2))[index] = tensor
        else:
            loaded[name] = tensor
    for key, parts in pieces.items():
        if any(p is None for p in parts):
            raise ValueError(f"checkpoint is missing part of {key}")
        loaded[key] = torch.cat(parts, dim=0)
    if model.config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(loaded))
    unexpected = sorted(set(loaded) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(loaded[name])
