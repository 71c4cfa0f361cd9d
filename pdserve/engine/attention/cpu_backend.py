"""The torch backend with decode attention read in place from the paged cache (`--attention-backend cpu`).

The torch backend gathers every decoding sequence's whole context into a padded tensor each
step, in every layer, then calls SDPA with a mask: at batch 1 and a few hundred tokens of
context that gather and SDPA took about 4 ms of a 40 ms step (docs/benchmarks.md). Here float32
decodes go to the C++ kernel of cpu_kernels/paged_attention.cpp, which walks each sequence's
block table and reads K and V rows where they lie, from a float32, float16 or bfloat16 cache.
Prefill chunks, and activations in other dtypes, keep the torch backend's path.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.torch_backend import TorchAttentionBackend, _PaddedGroup
from pdserve.engine.cpu_kernels import cpu_kernels


class CpuAttentionBackend(TorchAttentionBackend):
    def _decode(self, query, k_cache, v_cache, group: _PaddedGroup) -> torch.Tensor:
        if query.device.type != "cpu" or query.dtype != torch.float32:
            return super()._decode(query, k_cache, v_cache, group)
        return cpu_kernels().paged_decode_attention(
            query, k_cache, v_cache, group.block_table, group.context_lens, self.scale
        )
