"""Prefix-aware routing against round robin, in one run, on the shared-prefix workload.

For each policy in turn: start a cluster (embedded Redis, 2 prefill nodes, 1 decode node, the
gateway with `--router-policy`), send the same shared-prefix chat workload (K system prompts
of about --prefix-len words, each request one of them plus a distinct question) at a fixed
concurrency, and read from the gateway's /metrics how many prompt tokens the prefill nodes
served from their prefix caches. Prefill nodes get `--prefill-kv-cache-gib` each: enough for
about half of the system prompts, the regime where the node a prompt is sent to decides whether
its prefix is still cached (together the two caches hold them all).

    pdserve bench routing [--num-requests 128] [--num-prefixes 4] [--prefix-len 1000] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve import event_loop
from pdserve.bench.client import ClientConfig
from pdserve.bench.metrics import Distribution
from pdserve.bench.results import LevelResult, Load
from pdserve.bench.serving import run_benchmark
from pdserve.bench.workloads import WorkloadConfig, iter_conversations
from pdserve.options import add_model_flag

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "prefix_aware")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    level: LevelResult
    counters: GatewayCounters

    @property
    def hit_rate(self) -> float:
        c = self.counters
        return c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    @property
    def ttft(self) -> Distribution | None:
        return self.level.metrics.ttft


@dataclass(frozen=True)
class GatewayCounters:
    """What the gateway's /metrics says about prefill routing so far."""

    prompt_tokens: float
    cached_tokens: float
    prefill_decisions: Counter[str]  # reason -> prefill nodes picked for it

    def __sub__(self, other: GatewayCounters) -> GatewayCounters:
        return GatewayCounters(
            self.prompt_tokens - other.prompt_tokens,
            self.cached_tokens - other.cached_tokens,
            self.prefill_decisions - other.prefill_decisions,
        )


def gateway_counters(base_url: str) -> GatewayCounters:
    text = httpx.get(f"{base_url}/metrics", timeout=10, follow_redirects=True).text
    tokens = {"pdserve_gateway_prefill_prompt_tokens_total": 0.0, "pdserve_gateway_prefill_cached_tokens_total": 0.0}
    decisions: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in tokens:
                tokens[sample.name] += sample.value
            elif sample.name == "pdserve_gateway_routing_decisions_total" and sample.labels["role"] == "prefill":
                decisions[sample.labels["reason"]] += int(sample.value)
    return GatewayCounters(*tokens.values(), decisions)


def run_policy(policy: str, args: argparse.Namespace) -> PolicyResult:
    from pdserve.cluster_state.embedded_redis import free_port
    from pdserve.launcher import Launcher, LaunchPlan

    plan = LaunchPlan(
        model=args.model,
        port=free_port(),
        num_prefill=2,
        num_decode=1,
        prefill_args=("--kv-cache-gib", str(args.prefill_kv_cache_gib)),
        gateway_args=("--router-policy", policy),
    )
    workload = WorkloadConfig(
        kind="shared-prefix",
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        question_len=args.question_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    with Launcher(plan) as cluster:
        before = gateway_counters(cluster.base_url)
        client_config = ClientConfig(base_url=cluster.base_url, endpoint="chat", timeout_s=args.timeout_s)
        load = Load(concurrency=args.concurrency, num_requests=args.num_requests)
        # Both policies see the very same conversations (same tag); no warm-up: a cold cache is part of the test.
        _, (level,) = event_loop.run(
            run_benchmark(client_config, [load], lambda tag: iter_conversations(workload, "routing"), num_warmup=0)
        )
        after = gateway_counters(cluster.base_url)
    return PolicyResult(policy, level, after - before)


def format_markdown(results: Sequence[PolicyResult]) -> str:
    lines = [
        "| policy | requests ok | TTFT mean (ms) | TTFT p50 (ms) | TTFT p90 (ms) | prefix hit rate | output tok/s "
        "| prefill picks by reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m, ttft = r.level.metrics, r.ttft
        cells = [f"{ttft.mean:.0f}", f"{ttft.p50:.0f}", f"{ttft.p90:.0f}"] if ttft else ["-"] * 3
        cells = [r.policy, f"{m.num_succeeded}/{m.num_requests}", *cells, f"{r.hit_rate:.1%}"]
        cells += [f"{m.output_throughput:.1f}", _reasons(r.counters.prefill_decisions)]
        lines.append(f"| {' | '.join(cells)} |")
    by_policy = {r.policy: r for r in results}
    if {"round_robin", "prefix_aware"} <= by_policy.keys() and all(r.ttft for r in results):
        ratio = by_policy["round_robin"].ttft.mean / by_policy["prefix_aware"].ttft.mean
        lines.append(f"\nMean TTFT, round_robin / prefix_aware: {ratio:.2f}x")
    return "\n".join(lines)


def _reasons(decisions: Counter[str]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(decisions.items()))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench routing", description=__doc__.splitlines()[0])
    add_model_flag(parser)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument(
        "--prefix-len", type=int, default=1000, help="system prompt length in words (about one token each)"
    )
    parser.add_argument("--question-len", type=int, default=24, help="words")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefill-kv-cache-gib", type=float, default=0.13, help="each prefill node's KV cache")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    results = [run_policy(policy, args) for policy in args.policies]
    print(format_markdown(results))
    print(
        f"\n{args.num_requests} requests per policy, concurrency {args.concurrency}, {args.num_prefixes} prefixes of "
        f"{args.prefix_len} words; {time.perf_counter() - started:.0f} s in all"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        "policy": r.policy,
                        "hit_rate": r.hit_rate,
                        "ttft": r.ttft and vars(r.ttft),
                        "prefill_decisions": r.counters.prefill_decisions,
                    }
                    for r in results
                ],
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
