"""Weight-only quantized linear layers (`--quantization none|int8|int4`) for CPU decode steps.

A decode step at small batch streams every weight once per token, so its time is the weight
bytes over the memory bandwidth: int8 reads a quarter of float32's bytes, int4 an eighth.
Activations, norms, attention and the KV cache stay in the engine's dtype.

    int8  per output channel, symmetric: w = q * scale, q in [-127, 127]
    int4  groups of 32 along the input, asymmetric: w = q * scale + low, q in [0, 15]

Batches of up to 64 rows (decode steps) run the C++ kernels of cpu_kernels/quantized_gemv.cpp,
which read each weight byte once; torch's own kernels for these formats (_weight_int8pack_mm,
_weight_int4pack_mm_for_cpu) ran 2-8x slower than float32 on this machine (docs/benchmarks.md).
Larger batches (prefill chunks) are compute-bound: one dense matmul, in bfloat16 where the CPU
multiplies bfloat16 in hardware (activations rounded to bfloat16; the int8 weights are exact in
it), else in float32 on the dequantized weights.

The default model ships as Q4_1 GGUF blocks: 32 weights with w = d * q + m, q in [0, 15]. Those
are int4 groups of 32 exactly, and quantizing the dequantized float32 weights again finds the
same d and m (each block's smallest and largest q are 0 and 15), so `int4` computes with the very
weights the GGUF holds (tests/pdserve/engine/test_quantization.py checks this on the packaged file).
The LM head, tied to the Q8_0 embedding table, takes int8 in both modes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from pdserve.engine.cpu_kernels import cpu_isa, cpu_kernels

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32  # a Q4_1 block
MAX_GEMV_ROWS = 64  # the C++ kernels' limit (kMaxRows)


class QuantizedLinear(nn.Module):
    """The shape handling and the choice of path both formats share; subclasses hold the weights
    and say how each path multiplies a [rows, in] float batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_GEMV_ROWS or self.kernel_takes_prefill_chunks():
            y = self.gemv(rows.float().contiguous())
        elif fast_bfloat16_matmul():
            y = self.bfloat16_matmul(rows.bfloat16())
        else:
            y = torch.nn.functional.linear(rows, self.dense_weight(x.dtype))
        y = y.to(x.dtype).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def kernel_takes_prefill_chunks(self) -> bool:
        """Whether batches above MAX_GEMV_ROWS go to the C++ kernel too, not to a dense matmul."""
        return False

    def gemv(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def bfloat16_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(rows, self.dense_weight(torch.bfloat16))

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weights in `dtype`, for a dense matmul (made anew for every call)."""
        return self.dequantized().to(dtype)

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale).T + bias, with q int8 [out, in] and one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def kernel_takes_prefill_chunks(self) -> bool:
        """On AVX2 without native bfloat16: the kernel's integer path reads the int8 weights as
        they are, where the dense matmul first wrote a float32 copy of each (a 210-token prefill
        on 2 AMD EPYC cores: 770 -> 671 ms; the int16 products run at about float32's rate)."""
        return not fast_bfloat16_matmul() and "avx2" in cpu_flags()

    def gemv(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_kernels().int8_linear(rows, self.qweight, self.scale)

    def bfloat16_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        # q is exact in bfloat16 (integers below 256): only the activations round.
        return cpu_kernels().int8_bfloat16_linear(rows, self.qweight, self.scale)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]


@functools.cache
def fast_bfloat16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16): then quantized layers
    compute large batches (prefill chunks) in bfloat16, ~9x float32's speed on the Xeon of
    docs/benchmarks.md. Elsewhere (AVX2) bfloat16 is emulated and slower than float32;
    PDSERVE_CPU_ISA=avx2 says so too (cpu_kernels/__init__.py)."""
    if cpu_isa() == "avx2":
        return False
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where they cannot be read."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(flags.split(":", 1)[-1].split())


def int4_quantize(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE):
    """(q int32 [out, in] in [0, 15], scale [out, groups], low [out, groups]): each group of
    `group_size` input channels spans its own [low, low + 15 * scale]."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs in_features ({in_features}) divisible by the group size {group_size}")
    groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(out_features, in_features), scale, low


def int4_dequantize(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    out_features, num_groups = scale.shape
    groups = q.view(out_features, num_groups, -1).float()
    return (groups * scale[..., None] + low[..., None]).view(out_features, -1)


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values in [0, 15] -> [out, in / 2] bytes: in each group of 32, byte j holds
    input j (low nibble) and input 16 + j (high nibble), the layout quantized_gemv.cpp reads."""
    out_features, in_features = q.shape
    halves = q.to(torch.uint8).view(out_features, in_features // INT4_GROUP_SIZE, 2, INT4_GROUP_SIZE // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()


def int4_unpack(packed: torch.Tensor) -> torch.Tensor:
    out_features, half = packed.shape
    groups = packed.view(out_features, -1, INT4_GROUP_SIZE // 2)
    return torch.stack([groups & 15, groups >> 4], dim=2).reshape(out_features, half * 2).to(torch.int32)


class Int4Linear(QuantizedLinear):
    """y = x @ w.T + bias, w in asymmetric int4 groups of 32 input channels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scale, low = int4_quantize(weight)
        self.register_buffer("packed", int4_pack(q))
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("low", low.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def gemv(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_kernels().int4_linear(rows, self.packed, self.scale, self.low)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        # One pass in C++ (unpacking, float32 and bfloat16 copies in torch added ~90 ms to a
        # 210-token prefill), with the very values of dequantized().to(dtype).
        if dtype in (torch.float32, torch.bfloat16):
            return cpu_kernels().int4_dequantize(self.packed, self.scale, self.low, dtype == torch.bfloat16)
        return super().dense_weight(dtype)

    def dequantized(self) -> torch.Tensor:
        return int4_dequantize(int4_unpack(self.packed), self.scale, self.low)


def quantize_linears(model: nn.Module, mode: str) -> None:
    """Replaces the model's projections (and its LM head, with int8) in place; `none` keeps them."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return
    for layer in model.layers:
        for parent, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            setattr(parent, name, _quantized(getattr(parent, name), mode))
    # A tied head shares the embedding's Parameter: the embedding keeps it, the head gets a copy.
    model.lm_head = Int8Linear(model.lm_head.weight, None)


def _quantized(linear: nn.Linear, mode: str) -> nn.Module:
    return Int8Linear(linear.weight, linear.bias) if mode == "int8" else Int4Linear(linear.weight, linear.bias)
