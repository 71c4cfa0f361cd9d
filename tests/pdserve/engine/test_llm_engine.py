"""Greedy output of the engine equals transformers' generate(), through every scheduling path."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from pdserve.engine import CacheConfig, EngineConfig, EngineLoad, HeldPrompt, LLMEngine, SamplingParams, SchedulerConfig
from tests.factories import TINY_VOCAB, assert_greedy_equal, load_reference, reference_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def make_engine(
    path, num_blocks=64, max_num_batched_tokens=256, max_num_seqs=16, prefix_caching=True, attention_backend="torch"
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            attention_backend=attention_backend,
            cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        )
    )


@pytest.fixture(scope="module", params=[("llama", "torch"), ("qwen2", "torch"), ("llama", "triton")], ids="-".join)
def model_and_engine(request, tiny_llama_path, tiny_qwen2_path):
    """(folder, transformers reference, make_engine with an attention backend): both tiny
    architectures with the torch backend, and the triton backend (on CPU in Triton's
    interpreter: slow, and the architectures differ only in the projections' biases)."""
    arch, backend = request.param
    path = tiny_llama_path if arch == "llama" else tiny_qwen2_path
    return path, load_reference(path), functools.partial(make_engine, attention_backend=backend)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(length)]


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, every: int = 2
) -> dict[str, list[int]]:
    """Adds one prompt every `every` steps while the engine runs; returns id -> output tokens."""
    pending = [(f"req-{i}", p) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {rid: [] for rid, _ in pending}
    step = 0
    while pending or engine.has_unfinished_requests:
        if pending and step % every == 0:
            engine.add_request(*pending.pop(0), params)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
    return tokens


def assert_matches_reference(reference, prompts, outputs, max_tokens):
    for prompt, ours in zip(prompts, outputs):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, max_tokens)
        assert_greedy_equal(ours, ref_tokens, ref_logits)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 33, 100])
def test_single_prompt_lengths_around_block_boundaries(model_and_engine, length):
    path, reference, engine_for = model_and_engine
    engine = engine_for(path)
    prompt = random_prompt(length, seed=length)
    (out,) = engine.generate([prompt], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"
    assert_matches_reference(reference, [prompt], [out.token_ids], GREEDY.max_tokens)


def test_mixed_batch_submitted_at_different_steps(model_and_engine):
    path, reference, engine_for = model_and_engine
    engine = engine_for(path)
    prompts = [random_prompt(n, seed=i) for i, n in enumerate([1, 15, 16, 17, 33, 100, 7, 48])]
    tokens = run_staggered(engine, prompts, GREEDY)
    assert_matches_reference(reference, prompts, [tokens[f"req-{i}"] for i in range(8)], GREEDY.max_tokens)
    assert engine.kv_cache_manager.req_to_blocks == {}


def test_prefix_cache_hits_keep_output_identical(model_and_engine):
    path, reference, engine_for = model_and_engine
    engine = engine_for(path)
    system = random_prompt(48, seed=99)  # three full blocks shared by every request
    prompts = [system + random_prompt(n, seed=100 + n) for n in (5, 16, 30)]
    first = engine.generate(prompts[:1], GREEDY)
    rest = engine.generate(prompts[1:] + prompts[:1], GREEDY)  # shared prefix, then an identical prompt
    assert [r.num_cached_tokens for r in rest] == [48, 48, 48]
    assert rest[-1].token_ids == first[0].token_ids
    assert_matches_reference(
        reference, prompts, [first[0].token_ids] + [r.token_ids for r in rest[:2]], GREEDY.max_tokens
    )


def test_fully_cached_prompt_recomputes_its_last_block(model_and_engine):
    path, reference, engine_for = model_and_engine
    engine = engine_for(path)
    prompt = random_prompt(32, seed=5)
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 16  # one token must be computed to get logits
    assert second.token_ids == first.token_ids
    assert_matches_reference(reference, [prompt], [second.token_ids], GREEDY.max_tokens)


def test_chunked_prefill_with_budget_smaller_than_prompt(model_and_engine):
    path, reference, engine_for = model_and_engine
    engine = engine_for(path, max_num_batched_tokens=24)
    prompts = [random_prompt(100, seed=1), random_prompt(57, seed=2), random_prompt(3, seed=3)]
    outputs = engine.generate(prompts, GREEDY)
    assert_matches_reference(reference, prompts, [o.token_ids for o in outputs], GREEDY.max_tokens)


def test_preemption_when_the_pool_runs_out(model_and_engine):
    path, reference, engine_for = model_and_engine
    # 12 blocks of 16 tokens; four 40-token prompts growing to 60 tokens need 16 blocks.
    engine = engine_for(path, num_blocks=12, prefix_caching=False)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    prompts = [random_prompt(40, seed=10 + i) for i in range(4)]
    requests = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests:
        engine.step()
    assert [r.num_preemptions for r in requests] == [0, 0, 0, 1]  # the newest running request yields, once
    assert_matches_reference(reference, prompts, [r.output_token_ids for r in requests], params.max_tokens)
    assert engine.kv_cache_manager.num_free_blocks == 12


def test_abort_frees_blocks(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", random_prompt(40, seed=1), GREEDY)
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < 64
    engine.abort("a")
    assert not engine.has_unfinished_requests
    assert engine.kv_cache_manager.num_free_blocks == 64


def test_rejects_prompts_that_cannot_fit(tiny_llama_path):
    engine = make_engine(tiny_llama_path, num_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request("big", random_prompt(60, seed=1), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", random_prompt(10, seed=1), SamplingParams(max_tokens=600))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [TINY_VOCAB + 1], GREEDY)


class RecordingStorage:
    """A KvCacheStorage that hands out one preallocated tensor and records the spec it was asked for."""

    def __init__(self) -> None:
        self.spec = None
        self.tensor = None

    def allocate(self, spec):
        self.spec = spec
        self.tensor = torch.zeros(spec.shape, dtype=spec.dtype)
        return self.tensor


def test_the_engine_keeps_its_kv_cache_in_the_storage_its_caller_provides(tiny_llama_path):
    storage = RecordingStorage()
    config = EngineConfig(model=str(tiny_llama_path), cache=CacheConfig(block_size=16, num_blocks=24))
    engine = LLMEngine(config, kv_storage=storage)
    num_layers, num_kv_heads, head_dim = 2, 2, 16  # tests/factories.py tiny_config
    assert storage.spec.shape == (num_layers, 2, 24, 16, num_kv_heads, head_dim)
    assert all(k.data_ptr() == storage.tensor[layer, 0].data_ptr() for layer, (k, _) in enumerate(engine.kv_caches))
    prompt = random_prompt(40, seed=3)
    (out,) = engine.generate([prompt], GREEDY)
    assert out.token_ids == make_engine(tiny_llama_path).generate([prompt], GREEDY)[0].token_ids
    assert storage.tensor[:, :, :3].abs().sum() > 0  # the prompt's three blocks were written there


def test_the_layer_hook_sees_every_layer_of_the_step_that_completes_a_held_prompt(tiny_llama_path):
    calls = []
    config = EngineConfig(model=str(tiny_llama_path), cache=CacheConfig(block_size=16, num_blocks=24))
    engine = LLMEngine(config, layer_hook=lambda layer, held: calls.append((layer, held)))
    engine.add_request("plain", random_prompt(20, seed=1), SamplingParams(max_tokens=1))
    engine.add_request("held", random_prompt(40, seed=2), SamplingParams(max_tokens=1), hold_kv=True)
    engine.step()
    assert [layer for layer, _ in calls] == [0, 1]
    held_block_ids = engine.block_ids("held")
    assert all(held == [HeldPrompt("held", held_block_ids)] for _, held in calls)
    assert len(held_block_ids) == 3
    engine.release_kv("held")
    calls.clear()
    engine.add_request("later", random_prompt(20, seed=4), SamplingParams(max_tokens=1))
    engine.step()
    assert calls == []  # no held prompt in the step: the hook is not called


def test_load_counts_waiting_tokens_running_sequences_free_blocks_and_pending_transfers(tiny_llama_path):
    engine = make_engine(tiny_llama_path, num_blocks=24, max_num_batched_tokens=32)
    assert engine.load() == EngineLoad(num_free_blocks=24)
    engine.add_request("a", random_prompt(40, seed=1), GREEDY)
    assert engine.load() == EngineLoad(num_waiting_tokens=40, num_waiting_requests=1, num_free_blocks=24)
    engine.step()  # a 32-token chunk of the 40-token prompt
    assert engine.load() == EngineLoad(num_waiting_tokens=8, num_running=1, num_free_blocks=22)
    assert engine.reserve_prefilled("b", random_prompt(17, seed=2), GREEDY) is not None
    assert engine.load() == EngineLoad(num_waiting_tokens=8, num_running=1, num_free_blocks=20, num_pending_transfers=1)
