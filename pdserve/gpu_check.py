"""The one-command GPU check: `make gpu-check`, or `PYTHONPATH=. python3 -m pdserve.gpu_check`.

Runs from the source tree on a bare GPU machine (torch, triton, transformers, safetensors): it
imports the engine only, never the gateway. The models are random-weight, built from configs
(no weights travel with the tree): the default model's shape, and a ~1.1B Llama shape for
figures that mean something on a GPU. It prints one JSON summary:

  checks      pass/fail of the `gpu`-marked tests' checks (tests/gpu calls these same functions):
              greedy equality with transformers (float32, TF32 off), bfloat16 agreement with
              float32, the torch and triton backends against each other, CUDA graphs on vs off
  bandwidth   device-to-device copy bandwidth, measured first: the floor of what follows
  attention   the paged decode kernel at 4k context and batch 64, against that bandwidth
  decode      the batch-1 decode step (CUDA graphs) against the bandwidth floor
  throughput  offline output tok/s at 1, 32 and 256 concurrent requests (200-token prompts,
              128 output tokens), pdserve against transformers' generate_batch, same GPU
  kv_transfer_cuda_ipc  a second process writes a 1.4 GB cache's pages into this one's through
              CUDA IPC, layer by layer, against a device copy of the same bytes
  kv_transfer_grpc  the cross-host path on loopback: a GPU cache's pages through pinned host
              buffers and the gRPC stream into another GPU cache, layer by layer

`--smoke` runs every part on tiny shapes, on CPU under Triton's interpreter where no GPU is
present: the suite runs it so the script itself stays working between GPU sessions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated: before they import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from pdserve.gpu_check_grpc import grpc_bandwidth

DEFAULT_SHAPE = dict(  # SmolLM2-135M, the default model
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_1B_SHAPE = dict(  # TinyLlama-1.1B's shape
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip
SMOKE_SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_random_model(folder: Path, shape: dict, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random-weight Llama saved as safetensors (no tokenizer: the engine takes token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device()):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # wider logits than the init's near-uniform ones: greedy picks are not near-ties
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return folder


def engine(folder: Path, dtype: str = "float32", backend: str = "triton", eager: bool = False, **sched) -> LLMEngine:
    if torch.cuda.is_available():  # the last engine's cache and graphs go back before this one measures free memory
        gc.collect()
        torch.cuda.empty_cache()
    cache = CacheConfig(gpu_memory_utilization=0.5) if device() == "cuda" else CacheConfig(num_blocks=256)
    scheduler = SchedulerConfig(**sched) if sched else SchedulerConfig()
    config = EngineConfig(
        model=str(folder), dtype=dtype, device=device(), attention_backend=backend, enforce_eager=eager,
        cache=cache, scheduler=scheduler,
    )  # fmt: skip
    return LLMEngine(config)


def prompts(num: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=generator).tolist()


def greedy(llm: LLMEngine, token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(token_prompts, params)]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Share of identical tokens up to each row's first divergence, and those divergences."""
    same, total, first = 0, 0, []
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        same, total = same + n, total + len(b)
        first.append(n if n < len(b) else None)
    return {"agreement": round(same / max(total, 1), 4), "first_divergence": first}


def transformers_greedy(folder: Path, token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device()).eval()
    outputs = []
    with torch.no_grad():
        for prompt in token_prompts:
            ids = torch.tensor([prompt], device=device())
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    del model
    return outputs


def check_greedy_matches_transformers(folder: Path, vocab: int, backend: str = "triton") -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    token_prompts = prompts(4, 37, vocab)
    result = agreement(
        greedy(engine(folder, backend=backend), token_prompts, 16), transformers_greedy(folder, token_prompts, 16)
    )
    return {"ok": result["agreement"] == 1.0, **result}


def check_bfloat16_agrees_with_float32(folder: Path, vocab: int) -> dict:
    token_prompts = prompts(8, 50, vocab, seed=2)
    result = agreement(greedy(engine(folder, "bfloat16"), token_prompts, 32), greedy(engine(folder), token_prompts, 32))
    # Counted up to each row's first divergence (every later token counts as different), on
    # random weights whose logits have more near-ties than a trained model's.
    return {"ok": result["agreement"] >= 0.75, **result}


def check_backends_agree(folder: Path, vocab: int) -> dict:
    token_prompts = prompts(6, 45, vocab, seed=3)
    triton = greedy(engine(folder, backend="triton", eager=True), token_prompts, 16)
    result = agreement(triton, greedy(engine(folder, backend="torch"), token_prompts, 16))
    return {"ok": result["agreement"] == 1.0, **result}


def check_graphs_match_eager(folder: Path, vocab: int, dtype: str = "bfloat16") -> dict:
    token_prompts = prompts(5, 30, vocab, seed=4)
    graphs = greedy(engine(folder, dtype), token_prompts, 24)
    eager = greedy(engine(folder, dtype, eager=True), token_prompts, 24)
    return {"ok": graphs == eager, **agreement(graphs, eager)}


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device())
    target = torch.empty_like(source)
    return 2 * num_bytes / timed(lambda: target.copy_(source), 10)


def attention_bandwidth(batch: int, context: int, bandwidth: float) -> dict:
    from pdserve.engine.triton_kernels.attention import num_decode_splits, paged_decode_attention

    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    blocks_per_seq = context // block
    shape = (batch * blocks_per_seq, block, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device())
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * blocks_per_seq, device=device()).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device())
    query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device())
    splits = num_decode_splits(context)
    seconds = timed(lambda: paged_decode_attention(query, k_cache, v_cache, table, lens, head_dim**-0.5, splits), 20)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    return {
        "batch": batch, "context": context, "ms": round(seconds * 1e3, 3),
        "gb_per_s": round(kv_bytes / seconds / 1e9, 1), "share_of_copy": round(kv_bytes / seconds / bandwidth, 3),
    }  # fmt: skip


def decode_step(folder: Path, bandwidth: float, prompt_len: int) -> dict:
    """Batch-1 decode step time (CUDA graphs) against weights + KV bytes over the copy bandwidth."""
    llm = engine(folder, "bfloat16")
    max_tokens = llm.max_model_len - prompt_len
    llm.add_request("step", prompts(1, prompt_len, 1000)[0], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    llm.step()  # the prefill
    seconds = timed(llm.step, 50)
    weights = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
    kv = 2 * prompt_len * sum(k.shape[2] * k.shape[3] * k.element_size() for k, _ in llm.kv_caches)
    floor = (weights + kv) / bandwidth
    llm.abort("step")
    return {"step_ms": round(seconds * 1e3, 3), "floor_ms": round(floor * 1e3, 3), "ratio": round(seconds / floor, 2)}


def pdserve_throughput(folder: Path, concurrency: int, prompt_len: int, output_len: int, vocab: int) -> float:
    llm = engine(folder, "bfloat16", max_num_seqs=max(concurrency, 1), max_num_batched_tokens=8192)
    token_prompts = prompts(concurrency, prompt_len, vocab, seed=concurrency)
    greedy(llm, token_prompts[:1], 2)  # warm-up
    start = time.perf_counter()
    outputs = greedy(llm, token_prompts, output_len)
    synchronize()
    return sum(len(o) for o in outputs) / (time.perf_counter() - start)


def transformers_throughput(folder: Path, concurrency: int, prompt_len: int, output_len: int, vocab: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device()).eval()
    token_prompts = prompts(concurrency, prompt_len, vocab, seed=concurrency)
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=token_prompts, generation_config=config)
    synchronize()
    elapsed = time.perf_counter() - start
    del model
    return sum(len(out.generated_tokens) for out in outputs.values()) / elapsed


def cuda_ipc_bandwidth(num_layers: int, num_blocks: int) -> dict:
    """A second process opens this one's exported KV cache and copies every block of its own
    cache into it, layer by layer, as a prefill node does; against a copy of the same bytes
    inside one process, in that same child."""
    from kvtransfer.cuda_ipc import export_kv_cache

    shape = (num_layers, 2, num_blocks, 16, 8, 128)
    stacked = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        handle = Path(tmp) / "handle.json"
        handle.write_bytes(export_kv_cache(stacked))
        layout = ",".join(map(str, (num_layers, *shape[2:], "bfloat16")))
        argv = [sys.executable, "-m", "pdserve.gpu_check", "--ipc-child", str(handle), layout]
        child = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    if child.returncode != 0:
        return {"ok": False, "error": child.stderr[-500:]}
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["landed"] = bool(stacked[-1, 1, -1].float().abs().sum() > 0)  # the child's writes are visible here
    result["ok"] = result["landed"]
    return result


def _ipc_child(handle_path: str, layout: str) -> None:
    from kvtransfer.base import copy_blocks
    from kvtransfer.cuda_ipc import open_kv_caches

    target = open_kv_caches(Path(handle_path).read_bytes(), layout)
    if target is None:
        raise SystemExit("this process cannot open the handle (another GPU?)")
    source = [(torch.randn_like(k), torch.randn_like(v)) for k, v in target]
    blocks = list(range(target[0][0].shape[0]))

    def send_all_layers() -> None:
        for (k, v), (target_k, target_v) in zip(source, target):
            copy_blocks(k, target_k, blocks, blocks)
            copy_blocks(v, target_v, blocks, blocks)

    local = [(torch.empty_like(k), torch.empty_like(v)) for k, v in source]

    def copy_locally() -> None:
        for (k, v), (local_k, local_v) in zip(source, local):
            local_k.copy_(k)
            local_v.copy_(v)

    num_bytes = sum(2 * k.numel() * k.element_size() for k, _ in source)
    ipc, same_process = timed(send_all_layers, 10), timed(copy_locally, 10)
    result = {
        "gib": round(num_bytes / 2**30, 2),
        "ipc_gb_per_s": round(num_bytes / ipc / 1e9, 1),
        "device_copy_gb_per_s": round(num_bytes / same_process / 1e9, 1),
        "share_of_device_copy": round(same_process / ipc, 3),
    }
    print(json.dumps(result))


def run(smoke: bool) -> dict:
    summary: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "smoke": smoke}
    summary["versions"] = {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        small_shape = SMOKE_SHAPE if smoke else DEFAULT_SHAPE
        small = build_random_model(Path(tmp) / "small", small_shape)
        vocab = small_shape["vocab_size"]
        checks = {
            "greedy_equals_transformers_triton": lambda: check_greedy_matches_transformers(small, vocab),
            "greedy_equals_transformers_torch": lambda: check_greedy_matches_transformers(small, vocab, "torch"),
            "bfloat16_agrees_with_float32": lambda: check_bfloat16_agrees_with_float32(small, vocab),
            "triton_and_torch_backends_agree": lambda: check_backends_agree(small, vocab),
        }
        if device() == "cuda":
            checks["cuda_graphs_match_eager"] = lambda: check_graphs_match_eager(small, vocab)
        summary["checks"] = {name: _guarded(fn) for name, fn in checks.items()}
        summary["bandwidth_gb_per_s"] = round(copy_bandwidth((1 << 20) if smoke else (1 << 30)) / 1e9, 1)
        bandwidth = summary["bandwidth_gb_per_s"] * 1e9
        summary["attention"] = _guarded(lambda: attention_bandwidth(*((2, 256) if smoke else (64, 4096)), bandwidth))
        large_shape = SMOKE_SHAPE if smoke else LLAMA_1B_SHAPE
        large = build_random_model(Path(tmp) / "large", large_shape, torch.bfloat16)
        summary["decode"] = _guarded(lambda: decode_step(large, bandwidth, 64 if smoke else 200))
        summary["throughput"] = _guarded(lambda: throughput(large, large_shape["vocab_size"], smoke))
    if device() == "cuda":
        summary["kv_transfer_cuda_ipc"] = _guarded(lambda: cuda_ipc_bandwidth(*((2, 8) if smoke else (22, 1024))))
    summary["kv_transfer_grpc"] = _guarded(lambda: grpc_bandwidth(*((2, 8) if smoke else (22, 256))))
    summary["ok"] = all(c.get("ok") for c in summary["checks"].values())
    return summary


def throughput(folder: Path, vocab: int, smoke: bool) -> dict:
    prompt_len, output_len = (16, 4) if smoke else (200, 128)
    rows = {}
    for concurrency in (1, 2) if smoke else (1, 32, 256):
        ours = pdserve_throughput(folder, concurrency, prompt_len, output_len, vocab)
        theirs = _guarded(
            lambda c=concurrency: {"tok_s": transformers_throughput(folder, c, prompt_len, output_len, vocab)}
        )
        row = {"pdserve_tok_s": round(ours, 1), "transformers_tok_s": theirs.get("tok_s") and round(theirs["tok_s"], 1)}
        if theirs.get("tok_s"):
            row["ratio"] = round(ours / theirs["tok_s"], 2)
        else:
            row["transformers_error"] = theirs.get("error")
        rows[str(concurrency)] = row
    return rows


def _guarded(fn: Callable[[], dict]) -> dict:
    """A part's result, or its error: one failing part does not hide the others' figures."""
    try:
        return fn()
    except Exception as error:  # reported in the summary, and the check fails
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--ipc-child", nargs=2, metavar=("HANDLE", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ipc_child:
        _ipc_child(*args.ipc_child)
        return 0
    summary = run(args.smoke)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
