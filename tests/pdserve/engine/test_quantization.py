"""Weight-only int8 / int4 linear layers (pdserve/engine/quantization.py): the kernels compute what
the dequantized weights compute, int4 holds the default model's Q4_1 weights exactly, and the
quantized engine's greedy tokens agree with float32's on the default model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine import EngineConfig, LLMEngine, quantization
from pdserve.engine.cpu_kernels import cpu_kernels
from pdserve.engine.model_loader import resolve_model
from pdserve.engine.quantization import (
    MAX_GEMV_ROWS,
    Int4Linear,
    Int8Linear,
    fast_bfloat16_matmul,
    int4_dequantize,
    int4_pack,
    int4_quantize,
    int4_unpack,
    quantize_linears,
)
from tests.factories import build_tiny_model


@pytest.fixture
def linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 96, bias=True)
    layer.bias.data.normal_()
    return layer


def test_int8_linear_computes_with_its_dequantized_weights_close_to_float(linear):
    x = torch.randn(2, 5, 128)
    quantized = Int8Linear(linear.weight, linear.bias)
    exact = torch.nn.functional.linear(x, quantized.dequantized(), linear.bias)
    torch.testing.assert_close(quantized(x), exact, rtol=1e-4, atol=1e-4)
    relative = (quantized(x) - linear(x)).norm() / linear(x).norm()
    assert relative < 0.01  # 8 bits per channel


def test_int4_linear_computes_with_its_dequantized_weights(linear):
    x = torch.randn(7, 128)
    quantized = Int4Linear(linear.weight, linear.bias)
    exact = torch.nn.functional.linear(x, int4_dequantize(*int4_quantize(linear.weight)), linear.bias)
    torch.testing.assert_close(quantized(x), exact, rtol=1e-4, atol=1e-4)
    relative = (quantized(x) - linear(x)).norm() / linear(x).norm()
    assert 0.01 < relative < 0.15  # 4 bits in groups of 32: coarse, not broken


def test_weights_already_on_an_int4_grid_quantize_losslessly():
    torch.manual_seed(1)
    q = torch.randint(0, 16, (64, 96), dtype=torch.int32)
    q[:, ::32] = 0  # every group of 32 spans its whole range, as a Q4_1 block does
    q[:, 1::32] = 15
    scale, low = torch.rand(64, 3) / 10, torch.randn(64, 3)
    weight = int4_dequantize(q, scale, low)
    assert torch.equal(int4_quantize(weight)[0], q)
    torch.testing.assert_close(int4_dequantize(*int4_quantize(weight)), weight, rtol=0, atol=1e-6)


def test_int4_holds_the_default_models_q4_1_weights_exactly():
    """Every projection of the packaged model was Q4_1 in the GGUF: requantizing the converted
    float32 weights in groups of 32 gives them back (to float rounding)."""
    tensors = load_file(str(resolve_model("smollm2-135m").path / "model.safetensors"))
    projections = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    for module, names in projections.items():
        for name in names:
            weight = tensors[f"model.layers.3.{module}.{name}.weight"]
            error = (int4_dequantize(*int4_quantize(weight)) - weight).abs().max()
            assert error <= 1e-6 * weight.abs().max(), (name, float(error))


def test_quantize_linears_replaces_every_projection_and_the_head(tmp_path):
    from transformers import AutoConfig

    from pdserve.engine.attention import get_attention_backend
    from pdserve.engine.models.llama import LlamaModel

    config = AutoConfig.from_pretrained(build_tiny_model(tmp_path))
    backend = get_attention_backend("torch", config.num_attention_heads, config.num_key_value_heads, 16)
    model = LlamaModel(config, backend)
    quantize_linears(model, "int4")
    layer = model.layers[0]
    kinds = {
        type(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    }
    assert kinds == {Int4Linear} and isinstance(model.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="quantization must be"):
        quantize_linears(model, "int3")


def test_quantization_is_cpu_only_and_named():
    with pytest.raises(ValueError, match="CPU kernels only"):
        EngineConfig(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="none, int8 or int4"):
        EngineConfig(quantization="fp8")


@pytest.mark.parametrize("num_rows", [1, 5, 16, 64, 65, 90, 131])  # int4: a dense matmul above 64 rows
def test_both_paths_compute_with_the_dequantized_weights(linear, num_rows):
    x = torch.randn(num_rows, 128)
    for quantized in (Int8Linear(linear.weight, linear.bias), Int4Linear(linear.weight, linear.bias)):
        exact = torch.nn.functional.linear(x, quantized.dequantized(), linear.bias)
        if num_rows > MAX_GEMV_ROWS and fast_bfloat16_matmul():  # activations rounded to bfloat16
            assert (quantized(x) - exact).norm() / exact.norm() < 0.01
        elif isinstance(quantized, Int4Linear) and num_rows == 1 and batch1_rounds_x_to_bytes(128):
            assert (quantized(x) - exact).norm() / exact.norm() < 1e-2  # int8 per group of x
        elif isinstance(quantized, Int4Linear) and num_rows <= MAX_GEMV_ROWS:
            # int16 activations, against nibbles in 0..15 (not centred): a few outputs move by 1e-4
            assert (quantized(x) - exact).norm() / exact.norm() < 1e-4
        else:
            torch.testing.assert_close(quantized(x), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_rows", [4, 7, 16, 31, 32, 33, 70, 210])  # both sides of the panels (32 rows)
def test_int8_prefill_chunks_multiply_in_the_kernel_with_any_row_and_column_count(num_rows):
    """Where bfloat16 is not native (AVX2), prefill chunks go to the kernel too: panels of 16
    weight rows against four rows of x at a time (AVX2 builds), or pairs of weight rows
    (AVX512-VNNI builds), with odd tails on both sides (97 = 6 * 16 + 1 outputs)."""
    torch.manual_seed(2)
    quantized = Int8Linear(torch.randn(97, 160), None)
    x = torch.randn(num_rows, 160)
    y = cpu_kernels().int8_linear(x, quantized.qweight, quantized.scale)
    exact = torch.nn.functional.linear(x, quantized.dequantized())
    assert (y - exact).norm() / exact.norm() < 1e-4  # int16 activations: up to 3e-5 of each row's largest entry


@pytest.mark.parametrize(("num_rows", "in_features", "out_features"), [(65, 128, 96), (210, 576, 97), (7, 33, 5)])
def test_int8_bfloat16_prefill_chunks_give_torchs_bfloat16_product_to_the_bit(num_rows, in_features, out_features):
    """Prefill chunks on CPUs with native bfloat16: the kernel's own widening of q and its scaled
    float epilogue around torch's matmul change no bit of what torch's conversions gave."""
    torch.manual_seed(3)
    quantized = Int8Linear(torch.randn(out_features, in_features), None)
    x = torch.randn(num_rows, in_features).bfloat16()
    y = cpu_kernels().int8_bfloat16_linear(x, quantized.qweight, quantized.scale)
    expected = torch.nn.functional.linear(x, quantized.qweight.bfloat16()).float() * quantized.scale
    assert y.dtype == torch.float32 and torch.equal(y, expected)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels().int8_bfloat16_linear(x.float(), quantized.qweight, quantized.scale)


@pytest.mark.parametrize(
    ("flags", "native_bfloat16", "to_kernel"),
    [({"avx2"}, False, True), ({"avx2", "avx512_bf16"}, True, False), (set(), False, False)],
)
def test_int8_prefill_chunks_go_to_the_kernel_on_avx2_without_native_bfloat16(
    linear, monkeypatch, flags, native_bfloat16, to_kernel
):
    monkeypatch.setattr(quantization, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(quantization, "fast_bfloat16_matmul", lambda: native_bfloat16)
    quantized = Int8Linear(linear.weight, linear.bias)
    kernel_rows = []
    gemv = quantized.gemv
    monkeypatch.setattr(quantized, "gemv", lambda rows: kernel_rows.append(len(rows)) or gemv(rows))
    quantized(torch.randn(3, 200, 128))  # a 600-token prefill chunk
    assert kernel_rows == ([600] if to_kernel else [])


def test_one_row_int8_products_do_not_overflow_at_the_extremes():
    """Batch 1 multiplies in integers (int16 activations): the largest activations against the
    largest weights over many inputs stay exact."""
    in_features = 3 * 4096 + 32  # several of the kernel's integer chunks, and a partial one
    weight = torch.full((4, in_features), 0.5)
    weight[1] = -0.5
    x = torch.full((1, in_features), 3.0)
    y = Int8Linear(weight, None)(x)
    torch.testing.assert_close(y, torch.tensor([[1.5, -1.5, 1.5, 1.5]]) * in_features, rtol=1e-6, atol=0)


@pytest.mark.parametrize("in_features", [128, 48])  # 48: not a multiple of the vector width
def test_one_row_int8_propagates_non_finite_inputs_and_handles_any_width(in_features):
    torch.manual_seed(1)
    quantized = Int8Linear(torch.randn(8, in_features), None)
    x = torch.randn(1, in_features)
    exact = torch.nn.functional.linear(x, quantized.dequantized())
    # int16 activations round each entry by up to 3e-5 of the largest one
    assert (quantized(x) - exact).norm() / exact.norm() < 1e-4
    x[0, 3] = float("nan")
    assert quantized(x).isnan().all()
    assert not quantized(torch.zeros(1, in_features)).any()


@pytest.mark.parametrize("in_features", [512, 576, 640, 768, 544])  # x held in registers (AVX-512); 544: not
def test_one_row_int8_with_x_in_registers_matches_the_dequantized_product(in_features):
    torch.manual_seed(2)
    quantized = Int8Linear(torch.randn(203, in_features), None)  # rows split unevenly between threads
    x = torch.randn(1, in_features)
    exact = torch.nn.functional.linear(x, quantized.dequantized())
    assert (quantized(x) - exact).norm() / exact.norm() < 1e-4
    peak = Int8Linear(torch.full((3, in_features), -0.5), None)(torch.full((1, in_features), 3.0))
    torch.testing.assert_close(peak, torch.full((1, 3), -1.5 * in_features), rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_rows", [9, 37])  # the dot-product loops; the panels
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_rows_with_a_non_finite_entry_give_non_finite_outputs_and_leave_the_others_alone(bad, num_rows):
    torch.manual_seed(3)
    quantized = Int8Linear(torch.randn(24, 64), None)
    x = torch.randn(num_rows, 64)
    x[6, 5] = bad
    y = cpu_kernels().int8_linear(x, quantized.qweight, quantized.scale)
    assert not y[6].isfinite().any()
    rest = torch.cat([x[:6], x[7:]])
    exact = torch.nn.functional.linear(rest, quantized.dequantized())
    torch.testing.assert_close(torch.cat([y[:6], y[7:]]), exact, rtol=1e-4, atol=1e-4)


def batch1_rounds_x_to_bytes(in_features: int) -> bool:
    """Whether one row of x against int4 weights of this width is rounded to int8 per group
    (int4_byte_inputs.cpp, on AVX2 without AVX512-VNNI; an even group count), not to int16."""
    return cpu_kernels().int4_batch1_input_bits == 8 and in_features % 64 == 0


def rounded_to_bytes_per_group(x: torch.Tensor) -> torch.Tensor:
    """x as int4_byte_inputs.cpp rounds it: each group of 32 to int8 steps of its largest entry / 127."""
    groups = x.view(*x.shape[:-1], -1, 32)
    peak = groups.abs().amax(-1, keepdim=True)
    # 127 / peak must be finite: a group whose entries are all under ~1e-36 rounds to zeros
    factor = torch.where(peak > 127 / torch.finfo(torch.float32).max, 127 / peak, torch.zeros_like(peak))
    return (torch.round(groups * factor) * (peak / 127)).view(x.shape)


@pytest.mark.parametrize("num_rows", [1, 5, 9, 16, 19, 37])  # batch 1; the dot-product loops; the panels (16 up)
@pytest.mark.parametrize(("out_features", "in_features"), [(97, 128), (8, 96), (5, 1536)])  # 96: an odd group count
def test_int4_rows_multiply_in_integers_close_to_their_dequantized_weights(num_rows, out_features, in_features):
    """Decode batches round x to int16 and multiply the nibbles in integers; the low terms take the
    rounded x's group sums, so the error is that of the rounding alone (as for int8), with tails
    of fewer than four weight rows. Batch 1 on AVX2 without VNNI rounds x to int8 per group
    instead, and computes the dequantized weights' product with that x."""
    torch.manual_seed(4)
    quantized = Int4Linear(torch.randn(out_features, in_features), None)
    x = torch.randn(num_rows, in_features) + 0.5  # not centred: the nibbles' products do not cancel
    exact = torch.nn.functional.linear(x, quantized.dequantized())
    if num_rows == 1 and batch1_rounds_x_to_bytes(in_features):
        with_rounded_x = torch.nn.functional.linear(rounded_to_bytes_per_group(x), quantized.dequantized())
        assert (quantized(x) - with_rounded_x).norm() / with_rounded_x.norm() < 1e-6
        assert (quantized(x) - exact).norm() / exact.norm() < 1e-2  # int8 per group: ~2e-3 of each group's largest
    else:
        assert (quantized(x) - exact).norm() / exact.norm() < 1e-4  # int16 activations: up to 3e-5 of the largest


@pytest.mark.parametrize("out_features", [1, 4, 7, 130])  # tails of fewer than four weight rows
def test_one_row_of_int4_products_with_x_in_bytes_is_the_dequantized_product_with_x_so_rounded(out_features):
    """int4_byte_inputs.cpp: each group of x rounded to int8 with its own scale (an outlier costs
    only its own group precision: here 0.5-2% of y's norm, where int16 per row, which the outlier
    coarsens for all, loses 0.03-0.08%), a group of
    zeros, a group too small for 127 / its largest entry to be finite, and the low terms."""
    if not batch1_rounds_x_to_bytes(576):
        pytest.skip("this CPU multiplies one row of x in int16 (AVX512-VNNI, or no AVX2)")
    torch.manual_seed(6)
    quantized = Int4Linear(torch.randn(out_features, 576), None)
    x = torch.randn(1, 576) + 0.3
    x[0, 40] = 90.0  # an activation outlier, as the default model's hidden states have
    x[0, 64:96] = 0.0
    x[0, 96:128] = 1e-38
    y = quantized(x)
    weight = quantized.dequantized().double()
    with_rounded_x = torch.nn.functional.linear(rounded_to_bytes_per_group(x).double(), weight)
    # Up to float32's rounding of sums whose terms reach ~300 (the outlier's products).
    torch.testing.assert_close(y.double(), with_rounded_x, rtol=1e-5, atol=1e-4)


def test_one_row_int4_products_are_exact_at_the_extremes():
    """The largest activations against the largest nibbles over many inputs: each group's products
    are exact in int32, and the groups add up in float. An even group count: the integer loops
    take two groups a step."""
    in_features = 4096 + 64
    q = torch.full((4, in_features), 15, dtype=torch.int32)
    q[:, ::32] = 0  # each group spans [low, low + 15 * scale]
    scale, low = torch.full((4, in_features // 32), 0.25), torch.full((4, in_features // 32), -1.0)
    weight = int4_dequantize(q, scale, low)
    x = torch.full((1, in_features), 3.0)
    y = Int4Linear(weight, None)(x)
    exact = torch.nn.functional.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=0)  # groups add up in float; an overflow would be ~1e4x off


@pytest.mark.parametrize("num_rows", [1, 6, 18])
def test_int4_rows_with_a_non_finite_entry_give_non_finite_outputs_and_leave_the_others_alone(num_rows):
    torch.manual_seed(5)
    quantized = Int4Linear(torch.randn(8, 128), None)
    x = torch.randn(num_rows, 128)
    x[-1, 70] = float("inf")
    y = quantized(x)
    assert not y[-1].isfinite().any()
    exact = torch.nn.functional.linear(x[:-1], quantized.dequantized())
    torch.testing.assert_close(y[:-1], exact, rtol=1e-4, atol=1e-4)
    assert not quantized(torch.zeros(num_rows, 128)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_dense_weights_for_prefill_are_the_dequantized_weights_bit_for_bit(dtype):
    """Prefill chunks multiply densely with weights dequantized in C++ (float32, bfloat16) or
    torch (other dtypes): the same values as dequantized().to(dtype)."""
    torch.manual_seed(6)
    quantized = Int4Linear(torch.randn(40, 160) * 3, None)
    dense = quantized.dense_weight(dtype)
    assert dense.dtype == dtype
    assert torch.equal(dense, quantized.dequantized().to(dtype))


def test_int4_packing_round_trips_and_matches_the_kernels_layout():
    q = torch.randint(0, 16, (8, 64), dtype=torch.int32)
    packed = int4_pack(q)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(int4_unpack(packed), q)
    # Byte j of a group: input j in the low nibble, input 16 + j in the high one.
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 16]) << 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_greedy_tokens_agree_with_float32_on_the_default_model(mode):
    """Teacher-forced: both models read float32's greedy continuations (pdserve bench quality)."""
    from pdserve.bench.quality import PROMPTS, greedy, teacher_forced_agreement

    reference = LLMEngine(EngineConfig(model="smollm2-135m"))
    quantized = LLMEngine(EngineConfig(model="smollm2-135m", quantization=mode))
    prompts = [reference.tokenizer(p)["input_ids"] for p in PROMPTS[:6]]
    continuations = greedy(reference, prompts, 16)
    assert teacher_forced_agreement(reference, quantized, prompts, continuations) >= 0.95


def test_int8_kernel_sums_long_rows_without_overflowing_its_integer_lanes():
    """1040 inputs at the largest int16 activation against the largest int8 weight: one int32 lane
    summing them all would pass 2**31; the kernel moves its lanes to float on the way."""
    quantized = Int8Linear(torch.ones(20, 1040), None)
    for num_rows in (1, 9, 37):  # one row, the dot-product loops, the panels
        y = cpu_kernels().int8_linear(torch.ones(num_rows, 1040), quantized.qweight, quantized.scale)
        torch.testing.assert_close(y, torch.full((num_rows, 20), 1040.0), rtol=1e-5, atol=0)
