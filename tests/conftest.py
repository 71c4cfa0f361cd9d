from __future__ import annotations

import os

import pytest
import torch

# Triton reads this when a kernel is decorated: set it before anything imports the kernels.
# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.factories import build_tiny_model, load_reference


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tiny_llama_path, tiny_qwen2_path):
    """(folder, transformers reference model) for each tiny architecture."""
    path = tiny_llama_path if request.param == "llama" else tiny_qwen2_path
    return path, load_reference(path)
