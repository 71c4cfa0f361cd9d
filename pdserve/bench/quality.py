"""What weight quantization costs in accuracy, next to what it buys in speed (`pdserve bench quality`).

For each `--quantization` mode against float32, on the same weights:

    agreement      teacher-forced greedy agreement: float32 generates `--tokens` greedy tokens
                   after each prompt; both models then read the same sequences, and the share of
                   positions where their argmax agrees is reported (a divergence does not
                   cascade into the rest of the sequence)
    first diverge  free-running greedy: per prompt, the index of the first token where the mode's
                   own generation leaves float32's (none: identical for all `--tokens`)
    perplexity     on a fixed English text, and its ratio to float32's
    batch-1        the agreement and the perplexity ratio again, with the mode's logits computed
                   one position a step, as a single stream's decode computes them (the prefill
                   runs many rows of x at once, and the quantized kernels round one row their
                   own way: int4 on AVX2 to int8 per group of 32)
    step ms        the offline decode step at batch 1, greedy as every load of `pdserve bench
                   compare` (median over `--tokens` steps); a sampled token (temperature 1)
                   adds its softmax and draw over the vocabulary, 0.2-0.6 ms per step on two
                   Zen 4 cores, which no weight bytes account for
    floor ms       that step's weight-streaming floor: the bytes of weights one step reads
                   (projections and LM head; the embedding reads one row) over the memory
                   read bandwidth (a sum over 1 GiB on huge pages, where the weights lie),
                   measured right before and right after that mode's steps: on a shared cloud
                   host it moved from 38 to 73 GB/s between runs minutes apart (AMD EPYC Zen 5),
                   so one figure per run made the floors of its later modes guesses

    pdserve bench quality [--model M] [--modes none,int8,int4] [--tokens 32] [--attention-backend cpu]
                          [--kv-cache-dtype float16] [--json F]

With `--kv-cache-dtype`, the measured engines keep K and V in that dtype; the reference stays float32.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.attention import BatchLayout
from pdserve.engine.config import KV_CACHE_DTYPES, CacheConfig
from pdserve.engine.huge_pages import empty_on_huge_pages
from pdserve.engine.kv_cache import KvCacheSpec, LocalKvCacheStorage, kv_caches_over

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "In machine learning, overfitting means",
    "Dear hiring manager, I am writing to",
    "The French Revolution began in",
    "A prime number is",
]

PERPLEXITY_TEXT = (
    "The river rose slowly through the spring, fed by snow that melted on the northern hills. "
    "Farmers along its banks watched the water each morning, measuring it against stones their "
    "grandparents had marked. When the level passed the third stone, they moved the animals to "
    "higher fields and carried seed grain into the lofts. Most years the flood stopped short of the "
    "houses, leaving behind a layer of dark silt that made the next harvest rich. Children were "
    "told stories of the great flood of the old king's reign, when the river reached the market "
    "square and boats were rowed between the stalls. Nobody living had seen such a year, but the "
    "stones were kept, and every spring someone walked down to read them.\n\n"
    "A computer stores numbers in binary, as sequences of ones and zeros. Integers are exact, but "
    "most fractions cannot be written exactly in binary, so floating-point numbers keep only the "
    "most significant digits and an exponent. Adding a very small number to a very large one can "
    "therefore lose the small number entirely. Programs that sum many values often sort them "
    "first, or keep a running correction term, to limit the error. Such details rarely matter in "
    "everyday code, yet they decide whether a simulation of the weather, a bank's ledger or a "
    "spacecraft's trajectory can be trusted."
)


def sequence_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Logits after every position of one sequence ([len, vocab], float32), computed by the
    engine's model in one prefill over a scratch KV cache of its own (the engine's is untouched)."""
    runner = engine.model_runner
    kv_caches, block_table = _scratch_kv_caches(engine, len(token_ids))
    layout = BatchLayout(
        query_lens=[len(token_ids)],
        context_lens=[len(token_ids)],
        block_tables=[block_table],
        num_decodes=0,
        slot_mapping=torch.arange(len(token_ids)),
        block_size=runner.block_size,
    )
    with torch.inference_mode():
        metadata = runner.model.layers[0].self_attn.backend.prepare(layout)
        hidden = runner.model(torch.tensor(token_ids), torch.arange(len(token_ids)), kv_caches, metadata)
        return runner.model.compute_logits(hidden)


def batch1_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """The logits of sequence_logits, computed as a decode at batch 1 computes them: one position a
    step, each attending to the cache the steps before it wrote. The quantized kernels round a
    single row of activations their own way (int4 on AVX2: to int8 per group of 32), so a prefill's
    figures do not tell what a single stream's tokens cost."""
    runner = engine.model_runner
    kv_caches, block_table = _scratch_kv_caches(engine, len(token_ids))
    logits = []
    with torch.inference_mode():
        for position, token in enumerate(token_ids):
            layout = BatchLayout(
                query_lens=[1],
                context_lens=[position + 1],
                block_tables=[block_table],
                num_decodes=1,
                slot_mapping=torch.tensor([position]),
                block_size=runner.block_size,
            )
            metadata = runner.model.layers[0].self_attn.backend.prepare(layout)
            hidden = runner.model(torch.tensor([token]), torch.tensor([position]), kv_caches, metadata)
            logits.append(runner.model.compute_logits(hidden))
    return torch.cat(logits)


def _scratch_kv_caches(engine: LLMEngine, num_tokens: int) -> tuple[list, list[int]]:
    """A KV cache of the engine's shape and dtype for one sequence of `num_tokens`, and its block table."""
    runner = engine.model_runner
    attn = runner.model.layers[0].self_attn
    num_blocks = -(-num_tokens // runner.block_size)
    layers = len(runner.model.layers)
    spec = KvCacheSpec(layers, num_blocks, runner.block_size, attn.num_kv_heads, attn.head_dim, runner.kv_dtype, "cpu")
    return kv_caches_over(LocalKvCacheStorage().allocate(spec)), list(range(num_blocks))


def greedy(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def teacher_forced_agreement(
    reference: LLMEngine, engine: LLMEngine, prompts, continuations, logits_of=sequence_logits
) -> float:
    """The share of continuation positions where `engine`'s argmax (its logits by `logits_of`) is
    the float32 reference's (by its prefill)."""
    agree = total = 0
    for prompt, continuation in zip(prompts, continuations):
        sequence = prompt + continuation
        region = slice(len(prompt) - 1, len(sequence) - 1)  # the positions that predict the continuation
        expected = sequence_logits(reference, sequence)[region].argmax(-1)
        predicted = logits_of(engine, sequence)[region].argmax(-1)
        agree += int((expected == predicted).sum())
        total += len(continuation)
    return agree / total


def first_divergence(reference_tokens: list[int], tokens: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(reference_tokens, tokens)) if a != b), None)


def perplexity(engine: LLMEngine, text: str, logits_of=sequence_logits) -> float:
    ids = engine.tokenizer(text)["input_ids"]
    logits = logits_of(engine, ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(nll))


def decode_step_ms(engine: LLMEngine, prompt: list[int], num_tokens: int) -> float:
    """Median time of one greedy decode step at batch 1 (the engine's own loop, after the prefill)."""
    params = SamplingParams(max_tokens=num_tokens + 1, ignore_eos=True, temperature=0.0)
    engine.add_request("step-timing", prompt, params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests:
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of weights a batch-1 decode step reads: every buffer and parameter but the embedding table."""
    model = engine.model_runner.model
    embedding = model.embed_tokens.weight
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers()) if t is not None}
    tied_head = getattr(model.lm_head, "weight", None) is embedding
    return sum(
        t.numel() * t.element_size()
        for ptr, t in tensors.items()
        if (ptr != embedding.data_ptr() or tied_head) and t.dim() > 0 and t.numel() > 4096
    )


def read_bandwidth_gbps(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second by a sum over a tensor far larger than the caches (torch's threads),
    on huge pages as the engine's weights are: on 4 KiB pages a VM's TLB misses halved it (Zen 4)."""
    source = empty_on_huge_pages((num_bytes // 4,), torch.float32).fill_(1.0)
    source.sum()
    best = min(_timed(source.sum) for _ in range(repeats))
    return num_bytes / best / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(
    model: str, modes: Sequence[str], num_tokens: int, attention_backend: str = "torch", kv_cache_dtype: str = "auto"
) -> dict:
    def engine_for(mode: str, backend: str = attention_backend, kv_dtype: str = kv_cache_dtype) -> LLMEngine:
        cache = CacheConfig(kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False, dtype=kv_dtype)
        return LLMEngine(EngineConfig(model=model, quantization=mode, attention_backend=backend, cache=cache))

    reference = engine_for("none", "torch", "auto")  # the accuracy reference: float32 weights and cache, SDPA
    prompts = [reference.tokenizer(p)["input_ids"] for p in PROMPTS]
    reference_tokens = greedy(reference, prompts, num_tokens)
    reference_ppl = perplexity(reference, PERPLEXITY_TEXT)
    results = {}
    for mode in modes:
        same_as_reference = (mode, attention_backend) == ("none", "torch") and kv_cache_dtype in ("auto", "float32")
        engine = reference if same_as_reference else engine_for(mode)
        tokens = greedy(engine, prompts, num_tokens)
        ppl = perplexity(engine, PERPLEXITY_TEXT)
        bandwidth_before = read_bandwidth_gbps()
        step_ms = decode_step_ms(engine, prompts[0], num_tokens)
        bandwidth = (bandwidth_before + read_bandwidth_gbps()) / 2
        weight_bytes = weight_bytes_per_step(engine)
        batch1_ppl = perplexity(engine, PERPLEXITY_TEXT, batch1_logits)
        results[mode] = {
            "kv_cache": engine.config.kv_cache_dtype,
            "agreement": teacher_forced_agreement(reference, engine, prompts, reference_tokens),
            "batch1_agreement": teacher_forced_agreement(reference, engine, prompts, reference_tokens, batch1_logits),
            "batch1_perplexity_ratio": batch1_ppl / reference_ppl,
            "identical_sequences": sum(a == b for a, b in zip(reference_tokens, tokens)),
            "first_divergence": [first_divergence(a, b) for a, b in zip(reference_tokens, tokens)],
            "perplexity": ppl,
            "perplexity_ratio": ppl / reference_ppl,
            "step_ms": step_ms,
            "read_bandwidth_gbps": bandwidth,
            "floor_ms": weight_bytes / (bandwidth * 1e9) * 1000,
            "weight_mb": weight_bytes / 1e6,
        }
    return {
        "model": model,
        "num_prompts": len(prompts),
        "tokens": num_tokens,
        "threads": torch.get_num_threads(),
        "attention_backend": attention_backend,
        "kv_cache_dtype": kv_cache_dtype,
        "cpu": platform.processor() or platform.machine(),
        "modes": results,
    }


def format_table(report: dict) -> str:
    lines = [
        f"{report['num_prompts']} prompts x {report['tokens']} greedy tokens; {report['threads']} threads; "
        f"--attention-backend {report['attention_backend']}; --kv-cache-dtype {report['kv_cache_dtype']}",
        "| mode | KV cache | agreement | identical sequences | first divergence | perplexity (ratio) "
        "| batch-1 agreement | batch-1 perplexity ratio | step ms | read GB/s | floor ms | step / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        diverged = [d for d in r["first_divergence"] if d is not None]
        first = f"min {min(diverged)}" if diverged else "none"
        lines.append(
            f"| {mode} | {r['kv_cache']} | {r['agreement']:.1%} "
            f"| {r['identical_sequences']}/{report['num_prompts']} | {first} "
            f"| {r['perplexity']:.3f} ({r['perplexity_ratio']:.4f}) "
            f"| {r['batch1_agreement']:.1%} | {r['batch1_perplexity_ratio']:.4f} | {r['step_ms']:.1f} "
            f"| {r['read_bandwidth_gbps']:.1f} | {r['floor_ms']:.1f} | {r['step_ms'] / r['floor_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench quality", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default="none,int8,int4", help="comma-separated --quantization modes")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--attention-backend", default="torch", choices=["torch", "cpu"], help="measured engines'")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="measured engines' (the reference: float32)"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = measure(args.model, args.modes.split(","), args.tokens, args.attention_backend, args.kv_cache_dtype)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
