"""Does a long prompt stall running streams? Decode ITL under long-prompt arrivals, and TTFT of
a 1,000-token prompt, for pdserve disaggregated (1 prefill + 1 decode) and colocated.

For each topology, clusters on this machine (`pdserve.launcher`):
  1. TTFT of a lone ~1,000-token prompt (median of 3, idle cluster), every node allowed all the
     cores (the decode node is idle then), so both topologies prefill with the same compute and
     the difference is what disaggregation adds: the RPC hops and the KV transfer;
  2. 16 streams decode `--stream-tokens` tokens each while ~2,000-token prompts arrive every
     `--long-every-s` seconds, the cores split between the node processes as `pdserve up`
     does; the inter-token latencies of the 16 streams give p50/p99.

    pdserve bench interference [--model M] [--stream-tokens 192]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Sequence

import httpx

from pdserve import event_loop
from pdserve.cluster_state.embedded_redis import free_port
from pdserve.launcher import Launcher, LaunchPlan
from pdserve.options import add_model_flag

NUM_STREAMS = 16


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


async def stream_times(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every token-bearing SSE chunk (first = TTFT), relative to the request start."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def measure_ttft(base_url: str, model: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await stream_times(client, model, token_prompt(64, 0), 4)  # warm-up
        ttfts = [(await stream_times(client, model, token_prompt(1000, 10 + i), 1))[0] for i in range(3)]
    return {"ttft_1000_ms": 1000 * statistics.median(ttfts)}


async def measure_interference(base_url: str, model: str, stream_tokens: int, long_every_s: float) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await stream_times(client, model, token_prompt(64, 0), 4)  # warm-up
        streams = [
            asyncio.create_task(stream_times(client, model, token_prompt(48, 100 + i), stream_tokens))
            for i in range(NUM_STREAMS)
        ]
        long_ttfts = []
        seed = 1000
        while not all(s.done() for s in streams):
            await asyncio.sleep(long_every_s)
            if all(s.done() for s in streams):
                break
            long_ttfts.append((await stream_times(client, model, token_prompt(2000, seed), 1))[0])
            seed += 1
        gaps = [b - a for s in streams for a, b in zip(s.result(), s.result()[1:])]
    return {
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "num_long_prompts": len(long_ttfts),
        "long_prompt_ttft_ms": 1000 * statistics.median(long_ttfts) if long_ttfts else float("nan"),
    }


def on_cluster(model: str, colocated: bool, num_threads: int | None, measure) -> dict[str, float]:
    """Starts a cluster, runs `measure(base_url, served_model)` against it, stops it."""
    plan = LaunchPlan(
        model=model, port=free_port(), colocated=colocated, node_args=("--kv-cache-gib", "0.5"), num_threads=num_threads
    )
    with Launcher(plan) as cluster:
        served = httpx.get(f"{cluster.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        return event_loop.run(measure(cluster.base_url, served))


def run_topology(model: str, colocated: bool, stream_tokens: int, long_every_s: float) -> dict[str, float]:
    all_cores = os.cpu_count() or 1  # step 1: every node gets every core (None: the launcher splits them)
    result = on_cluster(model, colocated, all_cores, measure_ttft)
    result.update(
        on_cluster(model, colocated, None, lambda url, m: measure_interference(url, m, stream_tokens, long_every_s))
    )
    return result


def format_table(results: dict[str, dict[str, float]]) -> str:
    disagg, coloc = results["disaggregated"], results["colocated"]
    rows = [
        ("TTFT, 1,000-token prompt (ms)", "ttft_1000_ms"),
        ("decode ITL p50 under long prompts (ms)", "itl_p50_ms"),
        ("decode ITL p99 under long prompts (ms)", "itl_p99_ms"),
        ("TTFT of the 2,000-token prompts (ms)", "long_prompt_ttft_ms"),
    ]
    lines = ["| metric | disaggregated | colocated | disaggregated / colocated |", "|---|---|---|---|"]
    for label, key in rows:
        lines.append(f"| {label} | {disagg[key]:.0f} | {coloc[key]:.0f} | {disagg[key] / coloc[key]:.2f}x |")
    lines.append(
        f"| long prompts sent during the streams | {disagg['num_long_prompts']} | {coloc['num_long_prompts']} | |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench interference", description=__doc__.splitlines()[0])
    add_model_flag(parser)
    parser.add_argument("--stream-tokens", type=int, default=192)
    parser.add_argument("--long-every-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    results = {
        "disaggregated": run_topology(args.model, False, args.stream_tokens, args.long_every_s),
        "colocated": run_topology(args.model, True, args.stream_tokens, args.long_every_s),
    }
    print(format_table(results))


if __name__ == "__main__":
    main()
