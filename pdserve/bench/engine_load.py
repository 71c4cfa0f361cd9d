"""The engine alone under a serving load: `pdserve-engine` in `pdserve bench compare`.

The same closed loop the HTTP client runs (at most N requests in flight, the next sent as one
finishes), but submitted straight to an in-process `LLMEngine` with the nodes' engine flags. A
token's time is the end of the step that produced it, so TTFT, TPOT and ITL here are what the
engine itself takes, and the served rows beside them show what the gateway, gRPC and SSE add.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import time
from collections import deque
from collections.abc import Sequence

from pdserve.bench import offline
from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.results import LevelResult, Load, round_tag
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.options import EngineOptions, add_flags, settings_from_args

logger = logging.getLogger(__name__)


def run_level(engine: LLMEngine, load: Load, prompts: Sequence[list[int]], output_len: int) -> LevelResult:
    """Runs every prompt, at most `load.concurrency` at a time; greedy, EOS ignored."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    waiting = deque(enumerate(prompts))
    started: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    records: list[RequestRecord] = []
    level_start = time.perf_counter()
    while waiting or started:
        while waiting and len(started) < load.concurrency:
            index, prompt = waiting.popleft()
            request_id = f"engine-load-{index}"
            engine.add_request(request_id, prompt, params)
            started[request_id], token_times[request_id] = time.perf_counter(), []
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            token_times[output.request_id] += [now] * len(output.new_token_ids)
            if output.finished:
                times = token_times.pop(output.request_id)
                start = started.pop(output.request_id)
                records.append(RequestRecord(start, now, tuple(times), len(times), output.num_prompt_tokens))
    return LevelResult(load, compute_metrics(records, time.perf_counter() - level_start), tuple(records))


def run_engine(args: argparse.Namespace, tokenizer) -> list[LevelResult]:
    """The nodes' engine in this process, under the clusters' loads and prompts (synthetic workload)."""
    return engine_levels(load_engine(args, tokenizer), args, tokenizer)


def load_engine(args: argparse.Namespace, tokenizer) -> LLMEngine:
    """The nodes' engine (--pdserve-flags) in this process, warmed up."""
    engine = engine_from_flags(args.model, args.pdserve_flags)
    warmup = offline.synthetic_prompts(tokenizer, offline.NUM_WARMUP_REQUESTS, args.input_len, tag="warmup")
    run_level(engine, Load(concurrency=1, num_requests=len(warmup)), warmup, offline.NUM_WARMUP_TOKENS)
    return engine


def engine_levels(engine: LLMEngine, args: argparse.Namespace, tokenizer, round_index: int = 0) -> list[LevelResult]:
    """Every concurrency level on the engine, with the clusters' prompts of that round."""
    results = []
    for concurrency in args.concurrency:
        load = Load(concurrency=concurrency, num_requests=max(concurrency, args.min_requests))
        tag = round_tag(load.tag, round_index)
        prompts = offline.synthetic_prompts(tokenizer, load.num_requests, args.input_len, tag=tag)
        results.append(run_level(engine, load, prompts, args.output_len))
        logger.info("engine at %d: %.1f tok/s", concurrency, results[-1].metrics.output_throughput)
    return results


def engine_from_flags(model: str, flags: str) -> LLMEngine:
    """An LLMEngine with the engine options among a node's flags (others, like --kv-transport, do
    not concern the engine and are ignored)."""
    parser = argparse.ArgumentParser(prog="--pdserve-flags")
    add_flags(parser, EngineOptions)
    known, _ = parser.parse_known_args(["--model", model, *shlex.split(flags)])
    return LLMEngine(settings_from_args(EngineOptions, known, parser).engine_config())
