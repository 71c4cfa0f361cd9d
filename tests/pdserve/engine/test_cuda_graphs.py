"""CUDA graphs for decode steps: the static-buffer bookkeeping (bucketing, padding rows that
write no KV) checked on CPU by replaying each bucket eagerly from the same buffers; the real
capture runs in the GPU check (tests/gpu)."""

from __future__ import annotations

import random

import torch

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.cuda_graphs import DecodeGraphs, bucket_sizes
from tests.factories import TINY_VOCAB


class EagerReplay:
    """Stands in for a captured graph: recomputes the bucket from the static buffers into its output."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.replays = 0

    def replay(self) -> None:
        self.graphs.outputs[self.size].copy_(self.graphs._forward(self.size))
        self.replays += 1


def triton_engine(path) -> LLMEngine:
    config = EngineConfig(model=str(path), attention_backend="triton", cache=CacheConfig(block_size=16, num_blocks=64))
    return LLMEngine(config)


def test_bucket_sizes_cover_every_batch_up_to_the_limit():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padded_bucket_replays_give_the_eager_tokens_and_write_no_stray_kv(tiny_llama_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = triton_engine(tiny_llama_path)
    want = [o.token_ids for o in eager.generate(prompts, params)]

    engine = triton_engine(tiny_llama_path)
    runner = engine.model_runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, 64 * 16, 16)  # buckets 1, 2, 4: three sequences pad to 4
    for size in graphs.buckets:
        graphs.outputs[size] = graphs._forward(size)
        graphs.graphs[size] = EagerReplay(graphs, size)
    runner.decode_graphs = graphs
    got = [o.token_ids for o in engine.generate(prompts, params)]

    assert got == want
    assert graphs.graphs[4].replays > 0  # the decode steps of all three went through the padded bucket
    for (k, v), (want_k, want_v) in zip(runner.kv_caches, eager.model_runner.kv_caches):
        # Same blocks in the same order: the same cache, and padding rows (slot -1) wrote nowhere.
        torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, want_v, rtol=1e-5, atol=1e-5)
