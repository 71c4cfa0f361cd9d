"""`pdserve bench compare`: pdserve's cluster modes and transformers' peers side by side, one run.

Every system gets the same prompts: bench/offline.py's synthetic English prompts of exactly
--input-len token ids, a fresh set per concurrency level (so no prefix cache carries over), each
generating exactly --output-len tokens (greedy, EOS ignored):

  pdserve disaggregated  1 prefill + 1 decode node and the gateway, embedded Redis (the Launcher,
                         as `pdserve up` runs it), loaded by `bench serve`'s client through
                         /v1/completions with token-id prompts
  pdserve colocated      one node computing both phases, same gateway
  pdserve engine         the nodes' engine (--pdserve-flags) in this process under the same closed
                         loop, no gateway, gRPC or HTTP (bench/engine_load.py; synthetic workload)
  generate_batch         transformers' continuous batching, all N prompts at once (offline)
  naive                  transformers generate(), one request after another (offline)

Lifecycle:
  1. per cluster mode: start it on free ports, wait until ready, warm up, then per concurrency N:
     N clients send max(N, --min-requests) requests; stop it before the next starts
  2. with no cluster running: the engine in this process, then llama-server if given, then the
     transformers peers, timed with bench.offline.measure
     (--paired-rounds N: pdserve-colocated and pdserve-engine alternate N rounds of every level
     instead, cluster up and engine loaded throughout, rounds merged: run_paired)
  3. print the markdown table (and write it to --output), optionally the raw results (--json)

The offline transformers peers have no TTFT, TPOT or ITL to measure: their cells are blank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from pdserve import event_loop
from pdserve.bench import offline
from pdserve.bench.client import ClientConfig
from pdserve.bench.llama_peer import GGUF_TYPES
from pdserve.bench.metrics import Distribution
from pdserve.bench.results import LevelResult, Load, merge_rounds, round_tag
from pdserve.bench.serving import run_benchmark
from pdserve.bench.workloads import Conversation, WorkloadConfig, iter_conversations, user
from pdserve.options import add_model_flag

logger = logging.getLogger(__name__)

CLUSTER_SYSTEMS = {"pdserve-disagg": False, "pdserve-colocated": True}  # system -> colocated
COLOCATED_SYSTEM = "pdserve-colocated"
ENGINE_SYSTEM = "pdserve-engine"
OFFLINE_SYSTEMS = ("generate_batch", "naive")
SYSTEMS = (*CLUSTER_SYSTEMS, ENGINE_SYSTEM, *OFFLINE_SYSTEMS)
PEERS = ("naive", "generate_batch")


@dataclass(frozen=True)
class CompareRow:
    """One system at one concurrency; latencies in ms, None where the system has none."""

    system: str
    concurrency: int
    output_throughput: float
    num_requests: int
    num_failed: int = 0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    itl_p99: float | None = None


def row_from_level(system: str, result: LevelResult) -> CompareRow:
    m = result.metrics
    return CompareRow(
        system,
        result.load.concurrency,
        m.output_throughput,
        m.num_requests,
        m.num_failed,
        ttft_p50=_stat(m.ttft, "p50"),
        ttft_p99=_stat(m.ttft, "p99"),
        tpot_p50=_stat(m.tpot, "p50"),
        itl_p99=_stat(m.itl, "p99"),
    )


def _stat(distribution: Distribution | None, name: str) -> float | None:
    return None if distribution is None else getattr(distribution, name)


def row_from_measurement(measurement: offline.Measurement) -> CompareRow:
    return CompareRow(measurement.system, measurement.concurrency, measurement.tokens_per_s, measurement.num_requests)


def ratio_to(rows: Sequence[CompareRow], row: CompareRow, peer: str) -> float | None:
    """`row`'s output throughput over `peer`'s at the same concurrency; None if the peer was not run."""
    peer_row = next((r for r in rows if r.system == peer and r.concurrency == row.concurrency), None)
    return None if peer_row is None else row.output_throughput / peer_row.output_throughput


def format_markdown(rows: Sequence[CompareRow]) -> str:
    header = [
        "system",
        "concurrency",
        "output tok/s",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p50 (ms)",
        "ITL p99 (ms)",
        "vs naive",
        "vs generate_batch",
    ]
    order = {system: index for index, system in enumerate(SYSTEMS)}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in sorted(rows, key=lambda r: (r.concurrency, order.get(r.system, len(order)))):
        cells = [
            row.system,
            str(row.concurrency),
            f"{row.output_throughput:.1f}",
            _ms(row.ttft_p50),
            _ms(row.ttft_p99),
            _ms(row.tpot_p50, digits=1),  # a few ms per token at small batches: tenths matter
            _ms(row.itl_p99),
            *(_ratio(ratio_to(rows, row, peer)) for peer in PEERS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(value: float | None, digits: int = 0) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def conversations_for(tokenizer, tag: str, num_requests: int, input_len: int, output_len: int) -> list[Conversation]:
    """offline.synthetic_prompts as token-id completions requests: the offline peers' very prompts."""
    prompts = offline.synthetic_prompts(tokenizer, num_requests, input_len, tag=tag)
    return [Conversation(index, ((user(prompt),),), (output_len,)) for index, prompt in enumerate(prompts)]


def conversation_source(args: argparse.Namespace, tokenizer, tag_to_num_requests: dict[str, int], round_index=0):
    """tag -> the conversations every system gets: the offline peers' synthetic prompts, or chats
    with shared system prompts (`--workload chat`, bench/workloads.py); each round its own (round_tag)."""
    if args.workload == "chat":
        config = WorkloadConfig(
            kind="chat",
            input_len=args.chat_turn_len,
            output_len=args.output_len,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            num_turns=args.num_turns,
        )
        return lambda tag: iter_conversations(config, round_tag(tag, round_index))

    def synthetic(tag: str) -> Iterator[Conversation]:
        prompts = round_tag(tag, round_index)
        return iter(conversations_for(tokenizer, prompts, tag_to_num_requests[tag], args.input_len, args.output_len))

    return synthetic


def run_cluster(system: str, args: argparse.Namespace, tokenizer) -> list[LevelResult]:
    """Starts one cluster mode, sweeps the concurrency levels through its gateway, stops it."""
    from pdserve.launcher import Launcher

    started_s = time.perf_counter()
    with Launcher(launch_plan(args, CLUSTER_SYSTEMS[system])) as cluster:
        logger.info("%s ready in %.0f s", system, time.perf_counter() - started_s)
        return sweep(cluster.base_url, args, tokenizer)


def launch_plan(args: argparse.Namespace, colocated: bool):
    """A cluster as `pdserve up` starts it, on a free port, its nodes given --pdserve-flags."""
    from pdserve.cluster_state.embedded_redis import free_port
    from pdserve.launcher import LaunchPlan

    node_args = tuple(shlex.split(args.pdserve_flags))
    return LaunchPlan(model=args.model, port=free_port(), colocated=colocated, node_args=node_args)


def sweep(base_url: str, args: argparse.Namespace, tokenizer, round_index: int = 0) -> list[LevelResult]:
    """Every concurrency level through one server's /v1/completions, after the warm-up (the first
    round's only); each round has prompts of its own (round_tag)."""
    loads = [Load(concurrency=c, num_requests=max(c, args.min_requests)) for c in args.concurrency]
    tag_to_num_requests = {load.tag: load.num_requests for load in loads} | {"warmup": offline.NUM_WARMUP_REQUESTS}
    client_config = ClientConfig(base_url=base_url, endpoint="completions", timeout_s=args.timeout_s)
    source = conversation_source(args, tokenizer, tag_to_num_requests, round_index)
    num_warmup = offline.NUM_WARMUP_REQUESTS if round_index == 0 else 0
    _, results = event_loop.run(run_benchmark(client_config, loads, source, num_warmup=num_warmup))
    return results


def run_paired(args: argparse.Namespace, tokenizer) -> tuple[list[LevelResult], list[LevelResult]]:
    """pdserve-colocated and pdserve-engine in --paired-rounds alternating rounds of every level, the
    cluster up and the engine loaded throughout; (served, engine) levels merged over rounds. Run one
    after the other, the two would each get a different host: its memory bandwidth moves in minutes."""
    from pdserve.bench.engine_load import engine_levels, load_engine
    from pdserve.launcher import Launcher

    engine = load_engine(args, tokenizer)
    served_rounds, engine_rounds = [], []
    with Launcher(launch_plan(args, colocated=True)) as cluster:
        for round_index in range(args.paired_rounds):
            served_rounds.append(sweep(cluster.base_url, args, tokenizer, round_index))
            engine_rounds.append(engine_levels(engine, args, tokenizer, round_index))
            logger.info("paired round %d of %d done", round_index + 1, args.paired_rounds)
    return merge_rounds(served_rounds), merge_rounds(engine_rounds)


def run_llama(gguf_type: str, gguf_file: Path, args: argparse.Namespace, tokenizer) -> list[LevelResult]:
    """One llama-server configuration under the clusters' very load (bench/llama_peer.py)."""
    from pdserve.bench.llama_peer import LlamaServer
    from pdserve.cluster_state.embedded_redis import free_port

    if args.workload == "chat":
        context_per_slot = args.prefix_len + args.num_turns * (args.chat_turn_len + args.output_len) + 256
    else:
        context_per_slot = args.input_len + args.output_len + 64
    server = LlamaServer(
        args.llama_server, gguf_file, free_port(), os.cpu_count() or 1, args.llama_parallel, context_per_slot
    )
    with server:
        logger.info("llama.cpp %s ready: %s", gguf_type, " ".join(server.command))
        return sweep(server.base_url, args, tokenizer)


def check_results(system: str, results: Sequence[LevelResult], output_len: int) -> list[str]:
    """Notes for the table on anything that makes a row less than it claims."""
    notes = []
    for result in results:
        m, label = result.metrics, f"{system} at concurrency {result.load.concurrency}"
        if m.num_failed:
            notes.append(f"{label}: {m.num_failed} of {m.num_requests} requests failed ({'; '.join(m.errors)})")
        lengths = {record.output_tokens for record in result.records if record.succeeded}
        if lengths - {output_len}:
            notes.append(f"{label}: output lengths {sorted(lengths)}, expected {output_len}")
    return notes


def run_compare(args: argparse.Namespace) -> tuple[list[CompareRow], list[str], dict]:
    from transformers import AutoTokenizer

    from pdserve.engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).path)
    rows, notes, raw = [], [], {}

    def record(system: str, results: list[LevelResult]) -> None:
        rows.extend(row_from_level(system, result) for result in results)
        notes.extend(check_results(system, results, args.output_len))
        raw[system] = [{"load": asdict(r.load), "metrics": asdict(r.metrics)} for r in results]

    paired = args.paired_rounds > 1 and {COLOCATED_SYSTEM, ENGINE_SYSTEM} <= set(args.systems)
    if paired and args.workload != "synthetic":
        raise SystemExit(f"--paired-rounds: {ENGINE_SYSTEM} runs the synthetic workload only")
    for system in [s for s in CLUSTER_SYSTEMS if s in args.systems]:
        if not (paired and system == COLOCATED_SYSTEM):
            record(system, run_cluster(system, args, tokenizer))
    if paired:
        served, engine_results = run_paired(args, tokenizer)
        record(COLOCATED_SYSTEM, served)
        record(ENGINE_SYSTEM, engine_results)
    elif ENGINE_SYSTEM in args.systems:
        if args.workload == "synthetic":
            from pdserve.bench.engine_load import run_engine

            record(ENGINE_SYSTEM, run_engine(args, tokenizer))
        else:
            notes.append(f"{ENGINE_SYSTEM}: runs the synthetic workload only, not {args.workload}")
    if args.llama_server:
        from pdserve.bench.llama_peer import gguf_files

        for gguf_type, gguf_file in gguf_files(args.model, args.gguf_dir, tuple(args.llama_types)).items():
            record(f"llama.cpp {gguf_type}", run_llama(gguf_type, gguf_file, args, tokenizer))
    offline_systems = [s for s in OFFLINE_SYSTEMS if s in args.systems]
    if offline_systems:
        system_to_runner, _ = offline.build_runners(args.model, offline_systems)
        measurements = offline.measure(
            system_to_runner, tokenizer, args.concurrency, args.input_len, args.output_len, args.naive_max_requests
        )
        rows += [row_from_measurement(m) for m in measurements]
        if any(m.system == "naive" and m.num_requests < m.concurrency for m in measurements):
            notes.append(
                f"naive: timed on min(N, {args.naive_max_requests}) requests run one after another; "
                "sequential throughput does not depend on N, so it stands for N"
            )
        raw["offline"] = [asdict(m) | {"tokens_per_s": m.tokens_per_s} for m in measurements]
    return rows, notes, raw


def describe_run(args: argparse.Namespace, seconds: float) -> str:
    machine = f"{os.cpu_count()} CPUs, {platform.platform()}"
    if args.workload == "chat":
        workload = (
            f"chats of {args.num_turns} turns of {args.chat_turn_len}-token messages after one of "
            f"{args.num_prefixes} shared {args.prefix_len}-token system prompts, {args.output_len} output tokens a turn"
        )
    else:
        workload = f"prompts of {args.input_len} tokens, {args.output_len} output tokens"
    return (
        f"pdserve bench compare: {args.model}, {workload} (greedy, EOS ignored); "
        f"{date.today().isoformat()}, {machine}; took {seconds:.0f} s"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__.splitlines()[0])
    add_model_flag(parser)
    parser.add_argument("--concurrency", type=offline.int_list, default=[1, 8, 32], help="e.g. 1,8,32")
    parser.add_argument("--input-len", type=int, default=200, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--systems", type=offline.name_list(SYSTEMS), default=list(SYSTEMS), help=",".join(SYSTEMS))
    parser.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="clusters: at least this many requests per level, so that percentiles have samples",
    )
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=1,
        help="pdserve-colocated and pdserve-engine alternate this many rounds of every level, the cluster "
        "and the engine up throughout, and each one's rounds are merged: the served/engine ratio without "
        "the host's drift between two separate runs",
    )
    parser.add_argument(
        "--naive-max-requests", type=int, default=4, help="naive is timed on at most this many requests per concurrency"
    )
    parser.add_argument(
        "--workload",
        choices=["synthetic", "chat"],
        default="synthetic",
        help="synthetic: --input-len token prompts; chat: --num-turns turns of --chat-turn-len tokens after "
        "one of --num-prefixes shared system prompts of --prefix-len tokens",
    )
    parser.add_argument("--chat-turn-len", type=int, default=48, help="chat: tokens per user message")
    parser.add_argument("--num-turns", type=int, default=4, help="chat: turns per conversation")
    parser.add_argument("--num-prefixes", type=int, default=2, help="chat: distinct system prompts")
    parser.add_argument("--prefix-len", type=int, default=512, help="chat: system prompt tokens")
    parser.add_argument(
        "--pdserve-flags", default="", help="engine flags for pdserve's nodes, e.g. '--quantization int8'"
    )
    peer = parser.add_argument_group("llama.cpp peer (bench/llama_peer.py)")
    peer.add_argument("--llama-server", type=Path, help="a llama-server binary: adds llama.cpp rows")
    peer.add_argument(
        "--llama-types", type=offline.name_list(GGUF_TYPES), default=list(GGUF_TYPES), help=",".join(GGUF_TYPES)
    )
    peer.add_argument("--llama-parallel", type=int, default=8, help="llama-server's slots (-np)")
    peer.add_argument(
        "--gguf-dir", type=Path, default=Path.home() / ".cache" / "pdserve" / "gguf", help="where F16/F32 files go"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--output", type=Path, help="also write the markdown here")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.paired_rounds < 1:
        parser.error("--paired-rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    started_s = time.perf_counter()
    rows, notes, raw = run_compare(args)
    markdown = (
        "\n\n".join(
            filter(
                None,
                [
                    describe_run(args, time.perf_counter() - started_s),
                    format_markdown(rows),
                    "\n".join(f"- {note}" for note in notes),
                ],
            )
        )
        + "\n"
    )
    print(markdown, end="")
    if args.output:
        args.output.write_text(markdown)
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows], "raw": raw}, indent=2, default=str)
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
