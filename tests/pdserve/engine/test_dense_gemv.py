"""The float32 GEMV of cpu_kernels/dense_gemv.cpp (`dense_linear`), which the decode stack uses
for dense projections and the LM head, and `--attention-backend cpu`'s prefill chunks for their
float32 projections: at::linear's products up to rounding, for any shape and number of rows, the
same value for a row whatever it is batched with, and at::linear itself where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.cpu_kernels import cpu_kernels

BLOCK_ROWS = 64  # dense_gemv.cpp's kBlockRows: rows of x per pass over the weights


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, 9, 33, BLOCK_ROWS, BLOCK_ROWS + 3, 210])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (7, 40), (130, 1536), (5, 3)])
def test_dense_linear_is_at_linear_up_to_rounding(num_rows, out_features, in_features):
    torch.manual_seed(num_rows * 1000 + out_features + in_features)
    x = torch.randn(num_rows, in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    got = cpu_kernels().dense_linear(x, weight)
    assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
    # float64 as the reference: the kernel's rounding, not at::linear's, is what is measured
    expected = F.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_a_rows_result_does_not_depend_on_its_batch_or_the_thread_count():
    torch.manual_seed(3)
    # 600: a masked tail after the last whole vector; 2 blocks and a tail of rows, in tiles of 4
    # (AVX-512) or 2 (AVX2) with a partial last tile; 258 outputs: a partial last group of weights
    x = torch.randn(2 * BLOCK_ROWS + 7, 600)
    weight = torch.randn(258, 600)
    batched = cpu_kernels().dense_linear(x, weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu_kernels().dense_linear(x[i : i + 1], weight) for i in range(len(x))])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, alone)


def test_non_finite_inputs_propagate_to_their_row_only():
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    weight = torch.randn(16, 64).abs() + 0.1  # positive weights: inf * w stays inf, never inf - inf
    got = cpu_kernels().dense_linear(x, weight)
    assert torch.isfinite(got[0]).all()
    assert torch.isnan(got[1]).all()
    assert torch.isinf(got[2]).all()


def test_what_the_kernel_does_not_take_goes_to_at_linear():
    weight = torch.randn(32, 64)
    strided = torch.randn(64, 2)[:, :1].T  # [1, 64], not contiguous
    torch.testing.assert_close(cpu_kernels().dense_linear(strided, weight), F.linear(strided, weight))
    as_bf16 = torch.randn(2, 64, dtype=torch.bfloat16)
    assert cpu_kernels().dense_linear(as_bf16, weight.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        cpu_kernels().dense_linear(torch.randn(1, 63), weight)  # at::linear's own shape error
