"""The C++ decode stack (pdserve/engine/models/cpu_decode.py) that runs pure-decode steps under
`--attention-backend cpu`: the same tokens and log-probabilities as the module path, for every
projection kind and with biases, and only on the steps it can run."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.cpu_kernels import cpu_kernels
from pdserve.engine.models import cpu_decode
from tests.factories import build_tiny_model

PROMPTS = [[5, 9, 2, 7], [11] * 20, list(range(1, 40))]


def tiny_engine(folder, quantization: str, **cache) -> LLMEngine:
    config = EngineConfig(
        model=str(folder), quantization=quantization, attention_backend="cpu", cache=CacheConfig(block_size=8, **cache)
    )
    return LLMEngine(config)


def generate(engine: LLMEngine, max_tokens: int = 12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = engine.generate(PROMPTS, params)
    return [o.token_ids for o in outputs], torch.tensor([[lp.logprob for lp in o.logprobs] for o in outputs])


class CountedStack:
    def __init__(self, stack) -> None:
        self.stack, self.max_batch, self.calls = stack, stack.max_batch, 0
        self.compute_logits = stack.compute_logits

    def logits(self, *args):
        self.calls += 1
        return self.stack.logits(*args)


def count_stack_calls(engine: LLMEngine) -> CountedStack:
    engine.model_runner.decode_stack = CountedStack(engine.model_runner.decode_stack)
    return engine.model_runner.decode_stack


def count_module_calls(monkeypatch, engine: LLMEngine) -> list[int]:
    calls = [0]
    model = engine.model_runner.model
    forward = model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_the_stack_decodes_what_the_module_path_decodes(tmp_path, monkeypatch, arch, quantization):
    folder = build_tiny_model(tmp_path, arch)
    modules = tiny_engine(folder, quantization)
    modules.model_runner.decode_stack = None
    expected_tokens, expected_logprobs = generate(modules)

    engine = tiny_engine(folder, quantization)
    stack = count_stack_calls(engine)
    module_calls = count_module_calls(monkeypatch, engine)
    tokens, logprobs = generate(engine)

    assert tokens == expected_tokens
    # The quantized GEMV rounds each activation row to int16 steps of 3e-5 of its largest
    # entry: a float difference in the last bits between the two paths' own norm and rotary
    # code can move a value one step, so their log-probabilities agree less closely (1.2e-4
    # apart on an AVX2-only AMD EPYC, where the vector loops are 8 floats wide, not 16).
    atol = 1e-4 if quantization == "none" else 5e-4
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=atol)
    assert stack.calls == 11  # 12 tokens: the first comes from the prefill, 11 decode steps
    assert module_calls[0] == 1  # the one prefill step (all three prompts in one chunk)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_the_stack_writes_and_reads_16_bit_caches_as_the_module_path_does(tmp_path, kv_cache_dtype):
    folder = build_tiny_model(tmp_path)
    modules = tiny_engine(folder, "int8", dtype=kv_cache_dtype)
    modules.model_runner.decode_stack = None
    expected_tokens, expected_logprobs = generate(modules)

    engine = tiny_engine(folder, "int8", dtype=kv_cache_dtype)
    stack = count_stack_calls(engine)
    tokens, logprobs = generate(engine)

    assert engine.model_runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert stack.calls == 11
    assert tokens == expected_tokens
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=5e-4)
    # Both paths rounded every K and V row alike (round to nearest even), so the caches match.
    # (A last-bit difference between the two paths' float32 norm and rotary code may still move
    # a value by one 16-bit step.)
    for stack_caches, module_caches in zip(engine.model_runner.kv_caches, modules.model_runner.kv_caches):
        for from_stack, from_modules in zip(stack_caches, module_caches):
            torch.testing.assert_close(from_stack.float(), from_modules.float(), rtol=0, atol=0.02)


def batch1_step(engine: LLMEngine, context: int, token: int = 3):
    """The stack's inputs for one sequence of `context` positions, its blocks scattered over the
    pool, and its caches filled with random rows to attend to."""
    return decode_step(engine, [context], token)


def decode_step(engine: LLMEngine, contexts: list[int], token: int = 3):
    """batch1_step for a sequence of each context length, on blocks of their own."""
    torch.manual_seed(0)
    for k_cache, v_cache in engine.model_runner.kv_caches:
        k_cache.copy_(torch.randn(k_cache.shape))
        v_cache.copy_(torch.randn(v_cache.shape))
    block_size = engine.model_runner.kv_caches[0][0].shape[1]
    width = -(-max(contexts) // block_size)
    tables = torch.randperm(engine.model_runner.kv_caches[0][0].shape[0])[: len(contexts) * width].view(-1, width)
    last = torch.tensor(contexts) - 1
    slots = tables[torch.arange(len(contexts)), last // block_size] * block_size + last % block_size
    return torch.full((len(contexts),), token), last, slots, tables, torch.tensor(contexts)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("context", [5, 150])  # one share of the attention, and chunks on both threads
def test_a_batch_1_step_in_one_parallel_region_gives_the_per_operation_bits(tmp_path, arch, quantization, context):
    engine = tiny_engine(build_tiny_model(tmp_path, arch), quantization, dtype="float16", num_blocks=64)
    stack = engine.model_runner.decode_stack._stack
    assert stack.batch1_supported
    inputs = batch1_step(engine, context)
    results = {}
    for one_region in (True, False):
        stack.one_region_batch1 = one_region
        hidden = stack.forward(*inputs)
        results[one_region] = hidden, [cache.clone() for layer in engine.model_runner.kv_caches for cache in layer]
    (hidden, caches), (expected_hidden, expected_caches) = results[True], results[False]
    assert torch.equal(hidden, expected_hidden)
    assert all(torch.equal(cache, expected) for cache, expected in zip(caches, expected_caches, strict=True))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("context", [5, 150])
def test_a_quantized_lm_head_in_the_batch_1_region_gives_the_bits_of_the_head_after_the_stack(
    tmp_path, quantization, context
):
    engine = tiny_engine(build_tiny_model(tmp_path), quantization, dtype="float16", num_blocks=64)
    decode_stack = engine.model_runner.decode_stack
    assert decode_stack._stack.has_lm_head and decode_stack._stack.batch1_supported
    inputs = batch1_step(engine, context)
    expected = decode_stack.compute_logits(decode_stack._stack.forward(*inputs))  # the head as its own call
    results = {}
    for one_region in (True, False):
        decode_stack._stack.one_region_batch1 = one_region
        logits = decode_stack.logits(*inputs)
        results[one_region] = logits, [cache.clone() for layer in engine.model_runner.kv_caches for cache in layer]
    (logits, caches), (per_operation_logits, per_operation_caches) = results[True], results[False]
    assert logits.shape == (1, engine.model_runner.model.embed_tokens.num_embeddings)
    assert torch.equal(logits, expected)
    assert torch.equal(per_operation_logits, expected)
    assert all(torch.equal(cache, other) for cache, other in zip(caches, per_operation_caches, strict=True))


def test_a_batch_of_decodes_gets_the_stacks_head_after_the_per_operation_path(tmp_path):
    engine = tiny_engine(build_tiny_model(tmp_path), "int8", num_blocks=64)
    decode_stack = engine.model_runner.decode_stack
    inputs = decode_step(engine, [20, 9])
    expected = decode_stack.compute_logits(decode_stack._stack.forward(*inputs))
    assert torch.equal(decode_stack.logits(*inputs), expected)


def test_a_batch_1_step_that_meets_a_nan_falls_back_to_the_float_loops(tmp_path):
    engine = tiny_engine(build_tiny_model(tmp_path), "int8", num_blocks=64)
    stack = engine.model_runner.decode_stack._stack
    inputs = batch1_step(engine, 20)
    engine.model_runner.model.embed_tokens.weight.data[inputs[0]] = float("nan")  # the stack reads this tensor
    hidden = {}
    for one_region in (True, False):
        stack.one_region_batch1 = one_region
        hidden[one_region] = stack.forward(*inputs)
    assert hidden[True].isnan().all()
    torch.testing.assert_close(hidden[True], hidden[False], rtol=0, atol=0, equal_nan=True)


def test_a_batch_1_step_that_meets_a_nan_gives_nan_logits_as_the_float_loops_do(tmp_path):
    engine = tiny_engine(build_tiny_model(tmp_path), "int8", num_blocks=64)
    decode_stack = engine.model_runner.decode_stack
    inputs = batch1_step(engine, 20)
    engine.model_runner.model.embed_tokens.weight.data[inputs[0]] = float("nan")
    logits = decode_stack.logits(*inputs)
    assert logits.isnan().all()
    torch.testing.assert_close(
        logits, decode_stack.compute_logits(decode_stack._stack.forward(*inputs)), rtol=0, atol=0, equal_nan=True
    )


def test_only_integer_projections_take_the_one_region_batch_1_step(tmp_path):
    engine = tiny_engine(build_tiny_model(tmp_path), "none")
    assert not engine.model_runner.decode_stack._stack.batch1_supported
    assert not engine.model_runner.decode_stack._stack.has_lm_head  # a float32 head: cpu_decode's dense GEMV


def test_steps_with_a_prefill_chunk_keep_the_module_path(tmp_path):
    engine = tiny_engine(build_tiny_model(tmp_path), "int8")
    stack = count_stack_calls(engine)
    engine.add_request("first", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    engine.add_request("second", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # a decode of "first" beside the prefill of "second"
    assert stack.calls == 0
    engine.step()  # both decode
    assert stack.calls == 1


class CountedKernels:
    """cpu_kernels() with each dense_linear call's rows recorded by the weight it multiplies."""

    def __init__(self) -> None:
        self.dense_rows: dict[int, list[int]] = {}

    def __getattr__(self, name):
        return getattr(cpu_kernels(), name)

    def dense_linear(self, x, weight):
        self.dense_rows.setdefault(weight.data_ptr(), []).append(x.shape[0])
        return cpu_kernels().dense_linear(x, weight)


def test_a_float32_lm_head_goes_through_the_kernels_gemv_for_every_step(tmp_path, monkeypatch):
    engine = tiny_engine(build_tiny_model(tmp_path), "none")
    counted = CountedKernels()
    monkeypatch.setattr(cpu_decode, "cpu_kernels", lambda: counted)
    generate(engine, max_tokens=4)
    lm_head = engine.model_runner.model.lm_head.weight.data_ptr()
    assert counted.dense_rows[lm_head] == [3, 3, 3, 3]  # the prefill's last tokens, then 3 decode steps


def test_float32_prefill_projections_go_through_the_kernels_gemm(tmp_path, monkeypatch):
    engine = tiny_engine(build_tiny_model(tmp_path), "none")
    model = engine.model_runner.model
    projections = [
        p for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                              layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]  # fmt: skip
    assert all(isinstance(p, cpu_decode.KernelLinear) for p in projections)
    counted = CountedKernels()
    monkeypatch.setattr(cpu_decode, "cpu_kernels", lambda: counted)
    generate(engine, max_tokens=1)  # one step: the three prompts' prefill
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert all(counted.dense_rows[p.weight.data_ptr()] == [prompt_tokens] for p in projections)


@pytest.mark.parametrize("num_rows", [1, 5, 16, 17, 210])  # below, at and past the rows one thread takes
def test_the_kernel_norm_matches_torchs_and_gives_the_same_bits_at_any_thread_count(num_rows):
    torch.manual_seed(5)
    x, weight = torch.randn(num_rows, 576) * 3, torch.rand(576) + 0.5
    norm = cpu_kernels().rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(norm, torch.nn.functional.rms_norm(x, (576,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels().rms_norm(x, weight, 1e-5), norm)
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels().rms_norm(x.double(), weight, 1e-5)


def test_the_kernel_activation_matches_torchs():
    torch.manual_seed(6)
    gate_up = torch.randn(37, 2 * 96) * 4
    gate, up = gate_up.split(96, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(cpu_kernels().silu_and_mul(gate_up), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        cpu_kernels().silu_and_mul(gate_up[:, :-1].contiguous())


def test_prefill_chunks_norm_and_activate_with_the_kernels_that_decode_steps_use(tmp_path, monkeypatch):
    folder = build_tiny_model(tmp_path)
    engine = tiny_engine(folder, "int8")
    model = engine.model_runner.model
    norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(model.norm)
    mlps = [layer.mlp for layer in model.layers]
    rows = {"norm": [], "activation": []}
    kernels = cpu_kernels()

    def norm(x, weight, eps):
        rows["norm"].append(len(x))
        return kernels.rms_norm(x, weight, eps)

    def activation(gate_up):
        rows["activation"].append(len(gate_up))
        return kernels.silu_and_mul(gate_up)

    for n in norms:
        monkeypatch.setattr(n, "kernel", norm)
    for m in mlps:
        monkeypatch.setattr(m, "activation_kernel", activation)
    generate(engine, max_tokens=1)  # one step: the three prompts' prefill
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert rows == {"norm": [prompt_tokens] * len(norms), "activation": [prompt_tokens] * len(mlps)}
    torch_backend = LLMEngine(EngineConfig(model=str(folder), attention_backend="torch"))
    assert torch_backend.model_runner.model.norm.kernel is None
    assert torch_backend.model_runner.model.layers[0].mlp.activation_kernel is None


def test_quantized_and_other_backends_keep_their_own_projections(tmp_path):
    folder = build_tiny_model(tmp_path)
    quantized = tiny_engine(folder, "int8").model_runner.model.layers[0].mlp.down_proj
    assert not isinstance(quantized, cpu_decode.KernelLinear)
    torch_backend = LLMEngine(EngineConfig(model=str(folder), attention_backend="torch"))
    assert type(torch_backend.model_runner.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_other_backends_and_dtypes_have_no_stack(tmp_path):
    folder = build_tiny_model(tmp_path)
    torch_backend = LLMEngine(EngineConfig(model=str(folder), attention_backend="torch"))
    bfloat16 = LLMEngine(EngineConfig(model=str(folder), attention_backend="cpu", dtype="bfloat16"))
    assert torch_backend.model_runner.decode_stack is None
    assert bfloat16.model_runner.decode_stack is None


def test_the_stack_refuses_bad_inputs_instead_of_writing_out_of_bounds(tmp_path):
    kernels = cpu_kernels()
    with pytest.raises(RuntimeError, match="int8 projection takes 2 tensors"):
        kernels.Linear("int8", [torch.zeros(4, 4, dtype=torch.int8)], None)
    engine = tiny_engine(build_tiny_model(tmp_path), "int8", num_blocks=4)
    stack = engine.model_runner.decode_stack
    one = torch.tensor([1])
    table = torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="outside the cache"):
        stack(one, one, torch.tensor([4 * 8]), table, one)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        stack(one, torch.tensor([10**6]), one, table, one)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        stack(one.int(), one, one, table, one)
