"""The torch backend with decode attention read in place from the paged cache (`--attention-backend cpu`).

The torch backend gathers every decoding sequence's whole context into a padded tensor each
step, in every layer, then calls SDPA with a mask: at batch 1 and a few hundred tokens of
context that gather and SDPA took about 4 ms of a 40 ms step (docs/benchmarks.md). Here float32
decodes go to the C++ kernel of cpu_kernels/paged_attention.cpp, which walks each sequence's
block table and reads K and V rows where they lie, from a float32, float16 or bfloat16 cache.
Prefill chunks, and activations in other dtypes, keep the torch backend's path; under a 16-bit
cache (the quantized modes' default) prefill chunks attend in bfloat16 where the CPU multiplies it
natively: on two Xeon cores with AMX, SDPA took 0.28 ms against 0.77 for a 210-token chunk, and a
1024-token prefill 556-568 ms against 709-740. int8's greedy agreement with float32 went 97.9% ->
97.7% and its perplexity ratio 1.0046 -> 1.0021 (docs/benchmarks.md, twenty-second pass).
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.torch_backend import TorchAttentionBackend, _PaddedGroup
from pdserve.engine.cpu_kernels import cpu_kernels
from pdserve.engine.quantization import fast_bfloat16_matmul


class CpuAttentionBackend(TorchAttentionBackend):
    def _decode(self, query, k_cache, v_cache, group: _PaddedGroup) -> torch.Tensor:
        if query.device.type != "cpu" or query.dtype != torch.float32:
            return super()._decode(query, k_cache, v_cache, group)
        return cpu_kernels().paged_decode_attention(
            query, k_cache, v_cache, group.block_table, group.context_lens, self.scale
        )

    def _prefill(self, query, k_cache, v_cache, group: _PaddedGroup) -> torch.Tensor:
        if not bfloat16_prefill_attention(query, k_cache):
            return super()._prefill(query, k_cache, v_cache, group)
        return super()._prefill(query.bfloat16(), k_cache, v_cache, group).to(query.dtype)


def bfloat16_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a prefill chunk attends in bfloat16: under a 16-bit KV cache (the quantized modes'
    default, or --kv-cache-dtype), where the CPU multiplies bfloat16 natively."""
    return query.device.type == "cpu" and k_cache.element_size() == 2 and fast_bfloat16_matmul()
