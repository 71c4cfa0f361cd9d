"""Offline throughput: pdserve's engine against two transformers peers, measured in one run.

For each concurrency N, every system generates `output_len` tokens (greedy, EOS ignored) for the
same N distinct prompts of exactly `input_len` tokens:

  pdserve         all N prompts submitted at once to `LLMEngine.generate`
  naive           transformers `model.generate()`, one request after another
  generate_batch  transformers' own continuous batching, `model.generate_batch()`

Lifecycle of a run:
  1. load pdserve's engine and one transformers copy of the same weights (float32, sdpa)
  2. warm each system up on a few short requests
  3. per concurrency: fresh prompts (so no prefix cache carries over), time each system
  4. print the table of output tokens/s and ratios; optionally write JSON

Naive runs requests sequentially, so its throughput does not depend on N: it is timed on
min(N, --naive-max-requests) requests and that throughput stands for N.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import ContinuousBatchingConfig

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.model_loader import resolve_model
from pdserve.options import add_model_flag

logger = logging.getLogger(__name__)

SYSTEMS = ("pdserve", "naive", "generate_batch")
NUM_WARMUP_REQUESTS = 2
NUM_WARMUP_TOKENS = 8

Runner = Callable[[list[list[int]], int], list[list[int]]]

_SUBJECTS = (
    "the old fisherman",
    "a young engineer",
    "our neighbour",
    "the committee",
    "my sister",
    "a quiet student",
    "the river guide",
    "the baker",
    "every traveller",
    "the orchestra",
)
_VERBS = (
    "repaired",
    "painted",
    "described",
    "carried",
    "measured",
    "forgot",
    "ordered",
    "discovered",
    "borrowed",
    "explained",
)
_OBJECTS = (
    "a wooden boat",
    "the broken clock",
    "three maps of the coast",
    "an unusual recipe",
    "the winter garden",
    "a box of letters",
    "the mountain road",
    "a new telescope",
    "the village library",
    "two silver keys",
)
_TAILS = (
    "before sunrise.",
    "during the storm.",
    "with great care.",
    "for the first time.",
    "after the long meeting.",
    "near the harbour.",
    "without saying a word.",
    "in the spring of that year.",
    "while the others slept.",
    "as the bells rang.",
)


@dataclass(frozen=True)
class Measurement:
    """One timed run: `num_requests` requests (of `concurrency`) produced `num_output_tokens`."""

    system: str
    concurrency: int
    num_requests: int
    num_output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds


def synthetic_prompts(tokenizer, num_prompts: int, input_len: int, tag: str) -> list[list[int]]:
    """`num_prompts` distinct prompts of exactly `input_len` token ids, fixed by (`tag`, index)."""
    return [_synthetic_prompt(tokenizer, input_len, random.Random(f"{tag}/{i}")) for i in range(num_prompts)]


def _synthetic_prompt(tokenizer, input_len: int, rng: random.Random) -> list[int]:
    token_ids: list[int] = []
    while len(token_ids) < input_len:
        sentence = " ".join(rng.choice(words) for words in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS))
        token_ids += tokenizer.encode(" " + sentence.capitalize(), add_special_tokens=False)
    return token_ids[:input_len]


def load_peer_model(model_path: str | Path) -> PreTrainedModel:
    """The transformers copy of the weights both peers run: float32, sdpa attention.

    transformers 5.24 dropped the `paged|` prefix: `generate_batch` runs "sdpa" over its paged cache,
    which is what "paged|sdpa" named before.
    """
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def run_pdserve(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [list(output.token_ids) for output in engine.generate(prompts, params)]


def run_naive(model: PreTrainedModel, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    return [_generate_one(model, prompt, output_len) for prompt in prompts]


def _generate_one(model: PreTrainedModel, prompt: list[int], output_len: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    # min_new_tokens masks EOS until output_len, so every request yields exactly output_len tokens.
    output_ids = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=0,
    )
    return output_ids[0, len(prompt) :].tolist()


def run_generate_batch(model: PreTrainedModel, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    # eos_token_id=-1 is continuous batching's "no EOS": every request runs to max_new_tokens.
    generation_config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1)
    max_seq_len = max(map(len, prompts)) + output_len
    outputs = model.generate_batch(
        prompts,
        generation_config=generation_config,
        continuous_batching_config=generate_batch_config(len(prompts), max_seq_len),
    )
    # generate_batch returns results in input order, keyed by request id.
    return [list(output.generated_tokens) for output in outputs.values()]


def generate_batch_config(num_requests: int, max_seq_len: int, page_size: int = 64) -> ContinuousBatchingConfig:
    """Sizes the paged cache to hold every request at once, as pdserve's engine can.

    Left alone, transformers sizes the cache from free host RAM and its attention masks from
    8192-token batches: gigabytes on a CPU. 2048 batch tokens match pdserve's scheduler default.
    """
    num_blocks = num_requests * math.ceil(max_seq_len / page_size) + 1
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=2048,
        auto_switch_to_flash=False,
        use_cuda_graph=False,
    )


def time_system(
    system: str, runner: Runner, prompts: list[list[int]], output_len: int, concurrency: int
) -> Measurement:
    """Times one call of `runner`; raises if any request got other than `output_len` tokens."""
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = runner(prompts, output_len)
    seconds = time.perf_counter() - start
    lengths = [len(token_ids) for token_ids in outputs]
    if len(outputs) != len(prompts) or any(length != output_len for length in lengths):
        raise RuntimeError(f"{system}: expected {len(prompts)} x {output_len} tokens, got lengths {lengths}")
    return Measurement(system, concurrency, len(prompts), len(prompts) * output_len, seconds)


def warm_up(system: str, runner: Runner, tokenizer, input_len: int) -> None:
    prompts = synthetic_prompts(tokenizer, NUM_WARMUP_REQUESTS, input_len, tag="warmup")
    seconds = time_system(system, runner, prompts, NUM_WARMUP_TOKENS, NUM_WARMUP_REQUESTS).seconds
    logger.info("warmed up %s in %.1f s", system, seconds)


def measure(
    system_to_runner: dict[str, Runner],
    tokenizer,
    concurrencies: Sequence[int],
    input_len: int,
    output_len: int,
    naive_max_requests: int,
) -> list[Measurement]:
    for system, runner in system_to_runner.items():
        warm_up(system, runner, tokenizer, input_len)
    measurements = []
    for concurrency in concurrencies:
        prompts = synthetic_prompts(tokenizer, concurrency, input_len, tag=f"c{concurrency}")
        for system, runner in system_to_runner.items():
            num_timed = min(concurrency, naive_max_requests) if system == "naive" else concurrency
            measurement = time_system(system, runner, prompts[:num_timed], output_len, concurrency)
            logger.info("%s at %d: %.1f tok/s", system, concurrency, measurement.tokens_per_s)
            measurements.append(measurement)
    return measurements


def ratio(measurements: Sequence[Measurement], system: str, peer: str, concurrency: int) -> float | None:
    """Throughput of `system` over `peer` at `concurrency`; None if either was not measured."""
    by_key = {(m.system, m.concurrency): m for m in measurements}
    mine, theirs = by_key.get((system, concurrency)), by_key.get((peer, concurrency))
    if mine is None or theirs is None:
        return None
    return mine.tokens_per_s / theirs.tokens_per_s


def format_table(measurements: Sequence[Measurement], naive_max_requests: int) -> str:
    systems = [s for s in SYSTEMS if any(m.system == s for m in measurements)]
    peers = [p for p in ("naive", "generate_batch") if p in systems and "pdserve" in systems]
    header = ["concurrency", *(f"{s} tok/s" for s in systems), *(f"pdserve/{p}" for p in peers)]
    rows = [header]
    for concurrency in sorted({m.concurrency for m in measurements}):
        by_system = {m.system: m for m in measurements if m.concurrency == concurrency}
        cells = [str(concurrency)]
        cells += [f"{by_system[s].tokens_per_s:.1f}" if s in by_system else "-" for s in systems]
        cells += [_format_ratio(ratio(measurements, "pdserve", p, concurrency)) for p in peers]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines + _footnotes(measurements, naive_max_requests))


def _format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _footnotes(measurements: Sequence[Measurement], naive_max_requests: int) -> list[str]:
    notes = []
    single = {m.system: m for m in measurements if m.concurrency == 1 and m.system in ("pdserve", "naive")}
    if single:
        latencies = ", ".join(f"{s} {1000 / m.tokens_per_s:.1f} ms" for s, m in single.items())
        note = f"per-token latency at concurrency 1 (wall time / output tokens): {latencies}"
        if len(single) == 2:
            note += f" (pdserve/naive {single['naive'].tokens_per_s / single['pdserve'].tokens_per_s:.2f}x)"
        notes.append(note)
    if any(m.system == "naive" and m.num_requests < m.concurrency for m in measurements):
        notes.append(
            f"naive: timed on min(N, {naive_max_requests}) requests run one after another; "
            "sequential throughput does not depend on N, so it stands for N"
        )
    return notes


def to_json(measurements: Sequence[Measurement], args: argparse.Namespace) -> dict:
    concurrencies = sorted({m.concurrency for m in measurements})
    return {
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "measurements": [asdict(m) | {"tokens_per_s": m.tokens_per_s} for m in measurements],
        "ratios": {
            f"pdserve/{peer}": {str(c): ratio(measurements, "pdserve", peer, c) for c in concurrencies}
            for peer in ("naive", "generate_batch")
        },
    }


def build_runners(model: str, systems: Sequence[str]) -> tuple[dict[str, Runner], PreTrainedTokenizerBase]:
    """Loads what the chosen systems need; returns {system: runner} and the tokenizer."""
    model_path = resolve_model(model).path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    system_to_runner: dict[str, Runner] = {}
    if "pdserve" in systems:
        engine = LLMEngine(EngineConfig(model=model))
        system_to_runner["pdserve"] = lambda prompts, n: run_pdserve(engine, prompts, n)
    if "naive" in systems or "generate_batch" in systems:
        peer = load_peer_model(model_path)
        if "naive" in systems:
            system_to_runner["naive"] = lambda prompts, n: run_naive(peer, prompts, n)
        if "generate_batch" in systems:
            system_to_runner["generate_batch"] = lambda prompts, n: run_generate_batch(peer, prompts, n)
    return system_to_runner, tokenizer


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__.splitlines()[0])
    add_model_flag(parser)
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 32], help="e.g. 1,8,32")
    parser.add_argument("--input-len", type=int, default=200, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--systems", type=name_list(SYSTEMS), default=list(SYSTEMS), help=",".join(SYSTEMS))
    parser.add_argument(
        "--naive-max-requests", type=int, default=4, help="naive is timed on at most this many requests per concurrency"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def int_list(text: str) -> list[int]:
    """argparse type: a comma list of positive counts, e.g. concurrency levels `1,8,32`."""
    values = [int(part) for part in text.split(",")]
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text}")
    return values


def name_list(allowed: Sequence[str]):
    """argparse type: a comma list of names taken from `allowed`."""

    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = set(names) - set(allowed)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown systems {sorted(unknown)}; choose from {','.join(allowed)}")
        return names

    return parse


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    system_to_runner, tokenizer = build_runners(args.model, args.systems)
    measurements = measure(
        system_to_runner, tokenizer, args.concurrency, args.input_len, args.output_len, args.naive_max_requests
    )
    print(
        f"offline throughput, output tokens/s: {args.model}, input {args.input_len} tokens, "
        f"output {args.output_len} tokens, greedy, EOS ignored"
    )
    print(format_table(measurements, args.naive_max_requests))
    if args.json:
        args.json.write_text(json.dumps(to_json(measurements, args), indent=2))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
