"""`pdserve bench serve`: load an OpenAI-compatible server and report vLLM's serving metrics.

Lifecycle of a run:
  1. open one HTTP client; take the model from GET /v1/models unless --model names it
  2. warm up: a few short requests one after another, not measured; a failed one stops the run
  3. per load level (each --concurrency, or each --request-rate): a fresh stream of
     conversations, sent until --num-requests have been sent or --duration-s has passed, then
     wait for the requests in flight (each bounded by --timeout-s)
  4. metrics per level (bench/metrics.py); print a table per level and one across levels,
     optionally write JSON (--json) and plots (--plot)

Two ways to load the server:
  --concurrency N     N clients, each sending its next request when the last one is answered
  --request-rate R    conversations start at Poisson arrivals, R per second on average (seeded);
                      with --concurrency N as well, at most N requests are in flight
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
from tqdm import tqdm

from pdserve import event_loop
from pdserve.bench import plots, report
from pdserve.bench.client import ENDPOINT_TO_PATH, ClientConfig, StreamingClient
from pdserve.bench.metrics import RequestRecord, Slo, compute_metrics
from pdserve.bench.results import LevelResult, Load
from pdserve.bench.workloads import WORKLOADS, Conversation, WorkloadConfig, iter_conversations, turn_messages

logger = logging.getLogger(__name__)

WARMUP_MAX_TOKENS = 8
DEFAULT_CONCURRENCY = 8
DEFAULT_NUM_REQUESTS = 100

ConversationSource = Callable[[str], Iterator[Conversation]]  # tag -> an independent stream


class LoadGenerator:
    """Sends one level's requests through `client`; `run()` returns the records and the wall time."""

    def __init__(
        self,
        client: StreamingClient,
        conversations: Iterator[Conversation],
        load: Load,
        seed: int = 0,
        show_progress: bool = True,
    ):
        self.client = client
        self.load = load
        self.records: list[RequestRecord] = []
        self._conversations = conversations
        self._arrivals = random.Random(f"{seed}/{load.tag}/arrivals")
        self._num_sent = 0
        self._deadline: float | None = None
        self._in_flight = asyncio.Semaphore(load.concurrency) if load.concurrency else contextlib.nullcontext()
        self._progress = tqdm(
            total=load.num_requests,
            desc=load.label,
            unit="req",
            mininterval=0.5,
            disable=not show_progress,
            file=sys.stderr,
        )

    async def run(self) -> tuple[list[RequestRecord], float]:
        start_s = time.perf_counter()
        if self.load.duration_s is not None:
            self._deadline = start_s + self.load.duration_s
        try:
            if self.load.request_rate is None:
                await asyncio.gather(*(self._client_loop() for _ in range(self.load.concurrency)))
            else:
                await self._poisson_arrivals()
        finally:
            self._progress.close()
        return self.records, time.perf_counter() - start_s

    async def _client_loop(self) -> None:
        while (conversation := self._take()) is not None:
            await self._run_conversation(conversation)

    async def _poisson_arrivals(self) -> None:
        tasks = []
        while (conversation := self._take()) is not None:
            tasks.append(asyncio.create_task(self._run_conversation(conversation)))
            if self._may_send():  # no gap after the last arrival: it would only pad the duration
                gap_s = self._arrivals.expovariate(self.load.request_rate)
                await asyncio.sleep(min(gap_s, self._time_left_s()))
        await asyncio.gather(*tasks)

    def _take(self) -> Conversation | None:
        """The next conversation with its first request counted; None when the level is over."""
        if not self._may_send():
            return None
        conversation = next(self._conversations, None)
        if conversation is not None:
            self._num_sent += 1
        return conversation

    def _may_send(self) -> bool:
        if self.load.num_requests is not None and self._num_sent >= self.load.num_requests:
            return False
        return self._deadline is None or time.perf_counter() < self._deadline

    def _time_left_s(self) -> float:
        return float("inf") if self._deadline is None else max(0.0, self._deadline - time.perf_counter())

    async def _run_conversation(self, conversation: Conversation) -> None:
        """Its turns in order (the first already counted); a failed turn ends the conversation."""
        replies: list[str] = []
        for turn in range(conversation.num_turns):
            if turn > 0:
                if not self._may_send():
                    return
                self._num_sent += 1
            async with self._in_flight:
                messages = turn_messages(conversation, turn, replies)
                record, text = await self.client.send(messages, conversation.max_tokens[turn])
            self.records.append(record)
            self._progress.update(1)
            if not record.succeeded:
                return
            replies.append(text)


async def run_benchmark(
    client_config: ClientConfig,
    loads: Sequence[Load],
    conversations_for: ConversationSource,
    slo: Slo | None = None,
    num_warmup: int = 1,
    seed: int = 0,
    show_progress: bool = True,
) -> tuple[str, list[LevelResult]]:
    """Warms the server up, then runs each load level in turn; returns the model and the results."""
    async with StreamingClient(client_config) as client:
        await warm_up(client, conversations_for("warmup"), num_warmup)
        results = []
        for load in loads:
            generator = LoadGenerator(client, conversations_for(load.tag), load, seed, show_progress)
            records, duration_s = await generator.run()
            metrics = compute_metrics(records, duration_s, slo or Slo())
            logger.info(
                "%s: %d ok, %d failed, %.1f output tok/s",
                load.label,
                metrics.num_succeeded,
                metrics.num_failed,
                metrics.output_throughput,
            )
            results.append(LevelResult(load, metrics, tuple(records)))
        return client.model, results


async def warm_up(client: StreamingClient, conversations: Iterator[Conversation], num_requests: int) -> None:
    for conversation in [next(conversations) for _ in range(num_requests)]:
        max_tokens = min(conversation.max_tokens[0], WARMUP_MAX_TOKENS)
        record, _ = await client.send(turn_messages(conversation, 0, []), max_tokens)
        if not record.succeeded:
            raise RuntimeError(f"warm-up request to {client.config.root_url} failed: {record.error}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0])
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    server.add_argument("--model", help="default: the first model of GET /v1/models")
    server.add_argument("--endpoint", choices=list(ENDPOINT_TO_PATH), default="completions")
    server.add_argument("--api-key")
    server.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    server.add_argument("--temperature", type=float, default=0.0)
    server.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so that max_tokens fixes each output length",
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    workload.add_argument("--input-len", type=int, default=200, help="prompt (or per-turn message) tokens")
    workload.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    workload.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r)")
    workload.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    workload.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    workload.add_argument("--question-len", type=int, default=32, help="shared-prefix: question tokens")
    workload.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    workload.add_argument("--dataset", type=Path, help="jsonl: one {prompt|messages, max_tokens?} per line")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=_number_list(int), help=f"e.g. 1,8,32 (default {DEFAULT_CONCURRENCY})")
    load.add_argument("--request-rate", type=_number_list(float), help="Poisson arrivals per second, e.g. 1,2,4")
    load.add_argument("--num-requests", type=int, help=f"per level (default {DEFAULT_NUM_REQUESTS})")
    load.add_argument("--duration-s", type=float, help="per level: stop sending after this long")
    load.add_argument("--num-warmup", type=int, default=1, help="unmeasured requests first")
    load.add_argument("--seed", type=int, default=0)
    output = parser.add_argument_group("metrics and output")
    output.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    output.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    output.add_argument("--json", type=Path, help="write the results here")
    output.add_argument("--plot", type=Path, help="write latency CDFs (and sweep plots) as PNGs here")
    output.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _number_list(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [kind(part) for part in text.split(",")]
        if any(value <= 0 for value in values):
            raise argparse.ArgumentTypeError(f"values must be positive, got {text}")
        return values

    return parse


def loads_from_args(args: argparse.Namespace) -> list[Load]:
    """One Load per swept value: each concurrency, or each request rate (with one concurrency cap)."""
    num_requests = args.num_requests if args.num_requests or args.duration_s else DEFAULT_NUM_REQUESTS
    common = {"num_requests": num_requests, "duration_s": args.duration_s}
    if args.request_rate is None:
        return [Load(concurrency=c, **common) for c in args.concurrency or [DEFAULT_CONCURRENCY]]
    if args.concurrency is not None and len(args.concurrency) > 1:
        raise ValueError("sweep either --concurrency or --request-rate; with a rate, give one --concurrency cap")
    cap = args.concurrency[0] if args.concurrency else None
    return [Load(concurrency=cap, request_rate=rate, **common) for rate in args.request_rate]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        workload = WorkloadConfig(
            kind=args.workload,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            question_len=args.question_len,
            num_turns=args.num_turns,
            dataset=args.dataset,
            seed=args.seed,
        )
        client_config = ClientConfig(
            base_url=args.base_url,
            model=args.model,
            endpoint=args.endpoint,
            timeout_s=args.timeout_s,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            api_key=args.api_key,
        )
        loads, slo = loads_from_args(args), Slo(args.slo_ttft_ms, args.slo_tpot_ms)
        if args.plot:
            plots.require_matplotlib()
    except ValueError as error:
        sys.exit(f"pdserve bench serve: {error}")
    try:
        model, results = event_loop.run(
            run_benchmark(
                client_config,
                loads,
                lambda tag: iter_conversations(workload, tag),
                slo,
                args.num_warmup,
                args.seed,
                show_progress=not args.no_progress,
            )
        )
    except httpx.HTTPError as error:
        sys.exit(f"pdserve bench serve: cannot list models at {client_config.root_url}/v1/models ({error})")
    except (RuntimeError, ValueError) as error:  # a failed warm-up, or a workload the endpoint cannot take
        sys.exit(f"pdserve bench serve: {error}")
    print(report.format_results(model, args.workload, results))
    if args.json:
        report.write_json(args.json, model, vars(args), results)
    if args.plot:
        for path in plots.write_plots(results, args.plot):
            print(f"wrote {path}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
