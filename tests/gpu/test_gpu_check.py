"""The GPU check's checks (pdserve/gpu_check.py, which `make gpu-check` runs on a GPU
machine). The `gpu`-marked tests need CUDA and run there; the first test runs the same checks
on tiny shapes anywhere (on CPU under Triton's interpreter), so they keep working between
GPU sessions."""

from __future__ import annotations

import pytest
import torch

from pdserve import gpu_check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return gpu_check.build_random_model(tmp_path_factory.mktemp("gpu-check-tiny"), gpu_check.SMOKE_SHAPE)


@pytest.fixture(scope="module")
def default_shape_model(tmp_path_factory):
    return gpu_check.build_random_model(tmp_path_factory.mktemp("gpu-check-default"), gpu_check.DEFAULT_SHAPE)


def assert_ok(result: dict) -> None:
    assert result["ok"], result


def test_the_checks_pass_on_tiny_shapes(tiny_model):
    vocab = gpu_check.SMOKE_SHAPE["vocab_size"]
    assert_ok(gpu_check.check_greedy_matches_transformers(tiny_model, vocab))
    assert_ok(gpu_check.check_backends_agree(tiny_model, vocab))


def test_the_grpc_transfer_figure_pushes_every_page_on_tiny_shapes():
    result = gpu_check.grpc_bandwidth(num_layers=2, num_blocks=8)
    assert_ok(result)
    assert result["gb_per_s"] > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_greedy_equals_transformers_on_the_gpu(default_shape_model, backend):
    assert_ok(gpu_check.check_greedy_matches_transformers(default_shape_model, 49152, backend))


@pytest.mark.gpu
@needs_cuda
def test_bfloat16_agrees_with_float32(default_shape_model):
    assert_ok(gpu_check.check_bfloat16_agrees_with_float32(default_shape_model, 49152))


@pytest.mark.gpu
@needs_cuda
def test_backends_agree_on_the_gpu(default_shape_model):
    assert_ok(gpu_check.check_backends_agree(default_shape_model, 49152))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(default_shape_model, dtype):
    assert_ok(gpu_check.check_graphs_match_eager(default_shape_model, 49152, dtype))


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_pages_written_by_another_process_land_in_this_cache():
    assert_ok(gpu_check.cuda_ipc_bandwidth(2, 8))
