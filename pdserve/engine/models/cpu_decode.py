"""Pure-decode steps on the CPU in one C++ call (`--attention-backend cpu`, float32 activations).

A batch-1 decode step of the default model with int8 weights streamed its weights in ~7 ms but
took ~15 ms: the rest was the ~3000 small torch ops the Python module tree issues per step
(norms, rotary, slices, casts, the KV write), a few microseconds each. `CpuDecodeStack` hands
the same computation to cpu_kernels/decode_stack.cpp, which runs every layer as a few plain loops
around the GEMV and paged-attention kernels. Steps with prefill chunks keep the module path.
A float32 LM head (no --quantization) goes through the kernels' float32 GEMV too: torch's own
at::linear (MKL's sgemv) streamed it at 11 GB/s on an AMD EPYC Zen 5, 9.6 of a 40.8 ms step.
For the same reason `use_kernel_linears` sends the float32 projections of the steps the stack
does not run (prefill chunks) to that kernel: MKL ran 140-215 GFLOP/s there from 32 rows to 256,
the kernel 230-340 (docs/benchmarks.md, "fourteenth pass"). A quantized LM head goes into the
stack itself (`logits`), whose batch-1 step ends its parallel region with the head's rows.

The stack holds references to the model's weights and KV caches, not copies: it is built once,
after quantization, and reads whatever those tensors hold.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.cpu_kernels import cpu_kernels
from pdserve.engine.models.llama import MLP, LlamaModel, RMSNorm
from pdserve.engine.quantization import MAX_GEMV_ROWS, Int4Linear, Int8Linear


class CpuDecodeStack:
    max_batch = MAX_GEMV_ROWS  # the quantized GEMV kernels' row limit

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        kernels = cpu_kernels()
        first = model.layers[0].self_attn
        self._lm_head = model.lm_head
        self._stack = kernels.DecodeStack(
            first.num_heads, first.num_kv_heads, first.head_dim, model.norm.eps,
            model.embed_tokens.weight, model.cos_table, model.sin_table, model.norm.weight,
        )  # fmt: skip
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            self._stack.add_layer(
                layer.input_layernorm.weight, _linear(attn.qkv_proj), _linear(attn.o_proj),
                layer.post_attention_layernorm.weight, _linear(mlp.gate_up_proj), _linear(mlp.down_proj),
                k_cache, v_cache,
            )  # fmt: skip
        if isinstance(self._lm_head, (Int8Linear, Int4Linear)):
            self._stack.set_lm_head(_linear(self._lm_head))

    @staticmethod
    def supports(model: LlamaModel, device: torch.device, dtype: torch.dtype) -> bool:
        """Float32 on the CPU, with projections the kernels know (dense, int8 or int4)."""
        if device.type != "cpu" or dtype != torch.float32:
            return False
        projections = [
            p
            for layer in model.layers
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        return all(isinstance(p, (nn.Linear, Int8Linear, Int4Linear)) for p in projections)

    def __call__(self, input_ids, positions, slots, block_tables, context_lens) -> torch.Tensor:
        """The final-normed hidden states [B, hidden] of B sequences decoding one token each;
        writes every layer's new K/V at `slots` (all int64 tensors; block_tables [B, max_blocks])."""
        return self._stack.forward(input_ids, positions, slots, block_tables, context_lens)

    def logits(self, input_ids, positions, slots, block_tables, context_lens) -> torch.Tensor:
        """The LM head's logits [B, vocab] for the same inputs (the same bits as compute_logits
        of __call__'s states). A quantized head runs inside the stack: at batch 1, in the step's
        own parallel region."""
        if self._stack.has_lm_head:
            return self._stack.logits(input_ids, positions, slots, block_tables, context_lens)
        return self.compute_logits(self(input_ids, positions, slots, block_tables, context_lens))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits for rows of final-normed hidden states (any step's, any count)."""
        if isinstance(self._lm_head, nn.Linear) and self._lm_head.bias is None:
            return cpu_kernels().dense_linear(hidden.contiguous(), self._lm_head.weight)
        return self._lm_head(hidden).float()


class KernelLinear(nn.Linear):
    """An nn.Linear on float32 CPU weights whose products run cpu_kernels' `dense_linear`; it
    shares the Parameters of the layer it replaces."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> KernelLinear:
        with torch.device("meta"):
            kernel_linear = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        kernel_linear.weight, kernel_linear.bias = linear.weight, linear.bias
        return kernel_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = cpu_kernels().dense_linear(rows, self.weight).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def use_kernel_linears(model: LlamaModel) -> None:
    """Replaces the layers' float32 nn.Linear projections (not quantized ones) with KernelLinear."""
    for layer in model.layers:
        for parent, name in _PROJECTIONS:
            module = getattr(getattr(layer, parent), name)
            if type(module) is nn.Linear and module.weight.dtype == torch.float32:
                setattr(getattr(layer, parent), name, KernelLinear.sharing(module))


def use_kernel_elementwise(model: LlamaModel) -> None:
    """Gives the float32 RMSNorms and MLP activations the C++ ones that decode steps use: torch's
    CPU norm runs as separate passes (pow, mean, rsqrt, two products), and silu(gate) * up as
    three: a 1024-token int8 prefill took 411-429 ms with these against 464-476 on two Xeon cores
    (docs/benchmarks.md, twenty-second pass). Per row the same sums as the decode stack's, within
    float32 rounding of torch's."""
    kernels = cpu_kernels()
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.weight.dtype == torch.float32:
            module.kernel = kernels.rms_norm
        if isinstance(module, MLP):
            module.activation_kernel = kernels.silu_and_mul


_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def _linear(module: nn.Module):
    kernels = cpu_kernels()
    if isinstance(module, Int8Linear):
        return kernels.Linear("int8", [module.qweight, module.scale], module.bias)
    if isinstance(module, Int4Linear):
        return kernels.Linear("int4", [module.packed, module.scale, module.low], module.bias)
    return kernels.Linear("dense", [module.weight], module.bias)
