"""The `pdserve` command line.

pdserve generate --model M --max-tokens N [sampling flags] [--chat] (PROMPT ... | --prompts-file F)
pdserve fetch-model --model M
pdserve bench offline [--model M] [--concurrency 1,8,32] ...
pdserve bench serve [--base-url URL] [--workload W] [--concurrency 1,8,32 | --request-rate R] ...
pdserve bench compare [--model M] [--output FILE]
pdserve prefill | decode | colocated --model M --host H --port P --redis-url URL [--node-id ID]
pdserve gateway --model M --host H --port P --redis-url URL
pdserve up [--model M] [--host H] [--port P] [--prefill N] [--decode M] [--redis-url URL] [--colocated]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pdserve.log_setup import setup_logging

BENCH_KIND_TO_MODULE = {
    "offline": "pdserve.bench.offline",
    "serve": "pdserve.bench.serving",
    "compare": "pdserve.bench.compare",
    "transfer": "pdserve.bench.transfer",
    "interference": "pdserve.bench.interference",
    "routing": "pdserve.bench.routing",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m", help="alias (smollm2-135m), Hugging Face folder or .gguf file"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the paged KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-prefix-caching", action="store_true")


def engine_config_from_args(args: argparse.Namespace):
    from pdserve.engine import EngineConfig

    return EngineConfig.from_flags(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="run the engine offline; one JSON object per prompt and line")
    add_engine_arguments(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--prompts-file", help="one prompt per line")
    generate.add_argument("prompts", nargs="*")

    fetch = commands.add_parser("fetch-model", help="resolve a model and cache it as safetensors")
    fetch.add_argument("--model", default="smollm2-135m")

    for role in ("prefill", "decode", "colocated"):
        node = commands.add_parser(role, help=f"run one {role} node (gRPC)")
        add_engine_arguments(node)
        node.add_argument("--host", default="127.0.0.1")
        node.add_argument("--port", type=int, default=0, help="0 picks a free port")
        node.add_argument("--advertise-host", help="host other nodes dial (default: --host)")
        node.add_argument("--redis-url", required=True)
        node.add_argument("--node-id", default="")
        node.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
        node.add_argument("--kv-timeout-s", type=float, default=30.0, help="how long a decode node waits for pages")
        node.add_argument(
            "--kv-transport",
            choices=["auto", "grpc", "shm"],
            default="auto",
            help="auto: shared memory between nodes on one host, else the gRPC stream",
        )

    gateway = commands.add_parser("gateway", help="run the OpenAI-compatible gateway")
    gateway.add_argument("--model", default="smollm2-135m")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--redis-url", required=True)
    add_router_arguments(gateway)

    up = commands.add_parser("up", help="start Redis, the nodes and the gateway on this machine")
    up.add_argument("--model", default="smollm2-135m")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    up.add_argument("--colocated", action="store_true", help="one node doing prefill and decode, no KV transfer")
    up.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache memory per node")
    up.add_argument("--max-num-seqs", type=int, default=64)
    up.add_argument("--max-num-batched-tokens", type=int, default=2048)
    up.add_argument("--kv-transport", choices=["auto", "grpc", "shm"], default="auto")
    add_router_arguments(up)
    up.add_argument("--log-dir", help="keep each child's log here (default: a temporary folder)")
    up.add_argument("--ready-timeout-s", type=float, default=300.0)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    bench_kinds.add_parser("offline", help="engine throughput against transformers peers", add_help=False)
    bench_kinds.add_parser(
        "serve", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput", add_help=False
    )
    bench_kinds.add_parser("compare", help="pdserve clusters and transformers peers side by side", add_help=False)
    bench_kinds.add_parser("transfer", help="KV transfer bandwidth: gRPC, shared memory, memcpy", add_help=False)
    bench_kinds.add_parser(
        "interference", help="decode ITL under long prompts; TTFT: disaggregated vs colocated", add_help=False
    )
    bench_kinds.add_parser(
        "routing", help="prefix_aware vs round_robin routing on shared prefixes: TTFT, hit rate", add_help=False
    )
    return parser


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    # The names of gateway.settings.RoutingPolicy, spelled out: the CLI must not import the gateway to parse.
    parser.add_argument(
        "--router-policy",
        choices=["round_robin", "least_load", "prefix_aware"],
        default="prefix_aware",
        help="prefix_aware: where the prompt's prefix is cached, within a load cap",
    )
    parser.add_argument(
        "--router-load-factor",
        type=float,
        default=1.25,
        help="prefix_aware's cap: a node above this factor x the mean load (queued prompt tokens beyond one batched step on prefill nodes, requests on decode nodes) gets no new request",
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_KIND_TO_MODULE:
        import importlib

        # Each benchmark parses its own flags.
        bench_main = importlib.import_module(BENCH_KIND_TO_MODULE[argv[1]]).main
        setup_logging()
        bench_main(argv[2:])
        return 0
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command == "generate":
        return run_generate(args, parser)
    if args.command in ("prefill", "decode", "colocated"):
        return run_node(args)
    if args.command == "gateway":
        import asyncio

        from gateway.cluster_backend import serve_cluster_gateway
        from gateway.settings import GatewaySettings

        settings = GatewaySettings(
            model=args.model,
            host=args.host,
            port=args.port,
            redis_url=args.redis_url,
            router_policy=args.router_policy,
            router_load_factor=args.router_load_factor,
        )
        asyncio.run(serve_cluster_gateway(settings))
        return 0
    if args.command == "up":
        from pdserve.launcher import LaunchPlan, run_up

        node_args = (
            "--kv-cache-gib",
            str(args.kv_cache_gib),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--kv-transport",
            args.kv_transport,
        )
        plan = LaunchPlan(
            model=args.model,
            host=args.host,
            port=args.port,
            num_prefill=args.prefill,
            num_decode=args.decode,
            redis_url=args.redis_url,
            colocated=args.colocated,
            node_args=node_args,
            log_dir=args.log_dir,
            ready_timeout_s=args.ready_timeout_s,
            gateway_args=("--router-policy", args.router_policy, "--router-load-factor", str(args.router_load_factor)),
        )
        return run_up(plan)
    if args.command == "fetch-model":
        from pdserve.engine.model_loader import resolve_model

        print(resolve_model(args.model).path)
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


def run_node(args: argparse.Namespace) -> int:
    from pdserve.node import NodeSettings

    settings = NodeSettings(
        model=args.model,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        redis_url=args.redis_url,
        node_id=args.node_id,
        num_threads=args.num_threads,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_timeout_s=args.kv_timeout_s,
        kv_transport=args.kv_transport,
    )
    if args.command == "prefill":
        from prefill_service.server import run_prefill_node

        run_prefill_node(settings)
    else:
        from decode_service.server import run_decode_node

        run_decode_node(settings, role=args.command)
    return 0


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.engine import LLMEngine, SamplingParams

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        parser.error("give prompts as arguments or with --prompts-file")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(engine_config_from_args(args))
    except ValueError as error:
        parser.error(str(error))
    tokenizer = engine.tokenizer
    if tokenizer is None:
        parser.error(f"{args.model} has no tokenizer: pdserve generate needs one to read text prompts")
    prompt_ids = [encode_prompt(tokenizer, p, args.chat) for p in prompts]
    for prompt, ids, out in zip(prompts, prompt_ids, engine.generate(prompt_ids, params)):
        record = {
            "prompt": prompt,
            "prompt_token_ids": ids,
            "token_ids": out.token_ids,
            "text": tokenizer.decode(out.token_ids, skip_special_tokens=True),
            "finish_reason": out.finish_reason,
        }
        print(json.dumps(record, ensure_ascii=False), flush=True)
    return 0


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


if __name__ == "__main__":
    sys.exit(main())
