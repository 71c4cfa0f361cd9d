"""The `pdserve` command line: parses flags into each command's settings (pdserve/options.py)
and hands them to the piece that runs the command.

    pdserve generate [engine flags] [sampling flags] [--chat] (PROMPT ... | --prompts-file F)
    pdserve fetch-model --model M
    pdserve prefill | decode | colocated --redis-url URL [--port P] [--node-id ID] [engine flags]
    pdserve gateway --redis-url URL [--port P] [--router-policy P]
    pdserve up [--prefill N] [--decode M] [--colocated] [--redis-url URL] [engine and router flags]
    pdserve bench offline|serve|compare|transfer|interference|routing|chaos|quality [its own flags]

Every flag also reads from the environment: PDSERVE_<COMMAND>_<NAME> (see `pdserve <command> --help`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from gateway.settings import GatewaySettings
from pdserve.cluster_state.registry import NODE_ROLES
from pdserve.log_setup import setup_logging
from pdserve.options import (
    EngineOptions,
    GenerateSettings,
    KvTransferOptions,
    NodeSettings,
    TokenStreamOptions,
    UpSettings,
    add_flags,
    settings_from_args,
    to_flags,
)

BENCH_KIND_TO_HELP = {
    "offline": "engine throughput against transformers peers",
    "serve": "load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput",
    "compare": "pdserve clusters and transformers peers side by side",
    "transfer": "KV transfer bandwidth: gRPC, shared memory, memcpy",
    "interference": "decode ITL under long prompts; TTFT: disaggregated vs colocated",
    "routing": "prefix_aware vs round_robin routing on shared prefixes: TTFT, hit rate",
    "chaos": "load while a random node is killed every few seconds: completed, failed, migrated",
    "quality": "--quantization modes against float32: greedy agreement, perplexity, step time vs floor",
}
BENCH_KIND_TO_MODULE = {kind: f"pdserve.bench.{'serving' if kind == 'serve' else kind}" for kind in BENCH_KIND_TO_HELP}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="run the engine offline; one JSON object per prompt and line")
    add_flags(generate, GenerateSettings)
    generate.add_argument("prompts", nargs="*")
    fetch = commands.add_parser("fetch-model", help="resolve a model and cache it as safetensors")
    add_flags(fetch, EngineOptions, only=("model",))
    for role in NODE_ROLES:
        add_flags(commands.add_parser(role, help=f"run one {role} node (gRPC)"), NodeSettings)
    add_flags(commands.add_parser("gateway", help="run the OpenAI-compatible gateway"), GatewaySettings)
    add_flags(commands.add_parser("up", help="start Redis, the nodes and the gateway on this machine"), UpSettings)
    bench_kinds = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_kind", required=True)
    for kind, help_text in BENCH_KIND_TO_HELP.items():
        bench_kinds.add_parser(kind, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_KIND_TO_MODULE:
        import importlib

        # Each benchmark parses its own flags.
        bench_main = importlib.import_module(BENCH_KIND_TO_MODULE[argv[1]]).main
        setup_logging()
        bench_main(argv[2:])
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command == "generate":
        return run_generate(settings_from_args(GenerateSettings, args, parser), args.prompts, parser)
    if args.command in NODE_ROLES:
        from pdserve.node import run_node

        run_node(args.command, settings_from_args(NodeSettings, args, parser))
        return 0
    if args.command == "gateway":
        from gateway.server import serve_cluster_gateway
        from pdserve import event_loop

        event_loop.run(serve_cluster_gateway(settings_from_args(GatewaySettings, args, parser)))
        return 0
    if args.command == "up":
        return run_cluster(settings_from_args(UpSettings, args, parser))
    if args.command == "fetch-model":
        from pdserve.engine.model_loader import resolve_model

        print(resolve_model(settings_from_args(EngineOptions, args, parser).model).path)
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


def run_cluster(settings: UpSettings) -> int:
    from gateway.settings import AdmissionOptions, ApiKeyOptions, RequestLimitOptions, RouterOptions
    from pdserve.cluster_state.secret import generate_secret
    from pdserve.launcher import LaunchPlan, run_up
    from protos.tls import GrpcTlsOptions

    # One secret per cluster unless given: internal calls and registry entries carry it (cluster_state/secret.py).
    cluster_secret = settings.secret_value() or generate_secret()
    api_key_env = (("PDSERVE_GATEWAY_API_KEY", ",".join(settings.api_key)),) if settings.api_key else ()
    plan = LaunchPlan(
        model=settings.model,
        host=settings.host,
        port=settings.port,
        num_prefill=settings.prefill,
        num_decode=settings.decode,
        redis_url=settings.redis_url,
        colocated=settings.colocated,
        # Every node gets the engine, transfer and token stream options, the gateway the router and admission ones,
        # all of them the gRPC TLS paths (the launcher names the model, addresses and node ids itself).
        node_args=tuple(
            to_flags(settings, EngineOptions, KvTransferOptions, TokenStreamOptions, GrpcTlsOptions, exclude={"model"})
        ),
        gateway_args=tuple(
            to_flags(
                settings,
                RouterOptions,
                AdmissionOptions,
                RequestLimitOptions,
                ApiKeyOptions,
                GrpcTlsOptions,
                exclude={"api_key"},
            )
        ),
        # Keys and the secret go by environment, not argv, so that `ps` does not show them.
        gateway_env=api_key_env + (("PDSERVE_GATEWAY_CLUSTER_SECRET", cluster_secret),),
        node_env=(("PDSERVE_NODE_CLUSTER_SECRET", cluster_secret),),
        log_dir=settings.log_dir,
        ready_timeout_s=settings.ready_timeout_s,
    )
    return run_up(plan)


def run_generate(settings: GenerateSettings, prompts: list[str], parser: argparse.ArgumentParser) -> int:
    from pdserve.engine import LLMEngine

    prompts = list(prompts)
    if settings.prompts_file:
        with open(settings.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        parser.error("give prompts as arguments or with --prompts-file")
    try:
        params = settings.sampling_params()
        engine = LLMEngine(settings.engine_config())
    except ValueError as error:
        parser.error(str(error))
    tokenizer = engine.tokenizer
    if tokenizer is None:
        parser.error(f"{settings.model} has no tokenizer: pdserve generate needs one to read text prompts")
    prompt_ids = [encode_prompt(tokenizer, p, settings.chat) for p in prompts]
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
