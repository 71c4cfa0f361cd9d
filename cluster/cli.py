"""The `pdserve` command line.

    pdserve generate --model M --max-tokens N [sampling flags] [--chat] (PROMPT ... | --prompts-file F)
    pdserve fetch-model --model M
    pdserve bench offline [--model M] [--concurrency 1,8,32] ...
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cluster.log_setup import setup_logging


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias (smollm2-135m), Hugging Face folder or .gguf file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the paged KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-prefix-caching", action="store_true")


def engine_config_from_args(args: argparse.Namespace):
    from engine import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
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

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    bench_kinds.add_parser("offline", help="engine throughput against transformers peers", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:2] == ["bench", "offline"]:
        from bench.offline import main as bench_offline

        setup_logging()
        bench_offline(argv[2:])
        return 0
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command == "generate":
        return run_generate(args, parser)
    if args.command == "fetch-model":
        from engine.model_loader import resolve_model

        print(resolve_model(args.model).path)
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine import LLMEngine, SamplingParams

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
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


if __name__ == "__main__":
    sys.exit(main())
