"""Pieces of pdserve/engine/models/llama.py against transformers' own modules, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pdserve.engine.models.llama import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, num_tokens):
    torch.manual_seed(num_tokens)
    reference, ours = LlamaRMSNorm(576, eps=1e-5), RMSNorm(576, eps=1e-5)
    weight = torch.randn(576)
    with torch.no_grad():
        reference.weight.copy_(weight)
        ours.weight.copy_(weight)
    reference, ours = reference.to(dtype), ours.to(dtype)
    x = (torch.randn(num_tokens, 576) * 3).to(dtype)
    assert torch.equal(ours(x), reference(x))
