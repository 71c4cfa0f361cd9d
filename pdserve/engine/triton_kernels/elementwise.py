"""Triton kernels for the per-token work between matmuls: RMSNorm (fused with the residual add)
and the rotary embedding. Each is one pass over memory instead of torch's several kernels.

Both compute in float32 and round once at the end, as transformers does (RMSNorm upcasts;
the rotary tables are float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_stride, hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_out_ptr.dtype.element_ty).to(tl.float32)  # the sum is rounded where torch rounds it
        tl.store(residual_out_ptr + row * hidden_size + cols, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)  # transformers: weight * x.to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x [num_tokens, hidden]; with `residual`, of x + residual, and that sum is
    returned too (the next layer's residual): (normed, x + residual)."""
    num_tokens, hidden_size = x.shape
    assert x.stride(1) == 1, "rows must be contiguous"
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if num_tokens:
        _rmsnorm_kernel[(num_tokens,)](
            x, residual.contiguous() if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out,
            x.stride(0), hidden_size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden_size),
        )  # fmt: skip
    return out if residual is None else (out, residual_out)


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, positions_ptr,
    x_stride_t, x_stride_h, num_heads, head_dim,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    half = head_dim // 2
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < half)
    position = tl.load(positions_ptr + token).to(tl.int64)
    src = x_ptr + token * x_stride_t + h * x_stride_h
    first = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)  # [heads, half]
    second = tl.load(src + half + i, mask=mask, other=0.0).to(tl.float32)
    table = position * head_dim  # one row of each table serves every head
    cos_first = tl.load(cos_ptr + table + i, mask=i < half, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + table + half + i, mask=i < half, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + table + i, mask=i < half, other=0.0).to(tl.float32)  # signed: -sin
    sin_second = tl.load(sin_ptr + table + half + i, mask=i < half, other=0.0).to(tl.float32)
    dst = out_ptr + (token * num_heads + h) * head_dim
    tl.store(dst + i, (first * cos_first + second * sin_first).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + i, (second * cos_second + first * sin_second).to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, signed_sin_table: torch.Tensor):
    """The rotary embedding of x [num_tokens, num_heads, head_dim] (any row strides) at
    `positions`, from pdserve's float32 tables (cos, and sin with rotate_half's sign folded in);
    returns a new contiguous tensor. One program per token rotates all its heads."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1 and head_dim % 2 == 0
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, out, cos_table, signed_sin_table, positions,
            x.stride(0), x.stride(1), num_heads, head_dim,
            HEADS_PAD=triton.next_power_of_2(num_heads), HALF_PAD=triton.next_power_of_2(head_dim // 2),
        )  # fmt: skip
    return out
