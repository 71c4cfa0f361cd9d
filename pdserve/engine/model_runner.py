"""Runs one forward pass over a step's flat batch and samples the next tokens.

Per step: order sequences decodes-first, build flat input ids / positions / KV slots, let the
attention backend prepare its metadata once, run the model, compute logits only at the last
position of sequences that complete this step, and sample.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from pdserve.engine.attention import BatchLayout, get_attention_backend
from pdserve.engine.attention.backend import padded_block_tables
from pdserve.engine.config import EngineConfig
from pdserve.engine.huge_pages import move_to_huge_pages
from pdserve.engine.kv_cache import KvCacheSpec, KvCacheStorage, bytes_per_block, kv_caches_over
from pdserve.engine.models.cpu_decode import CpuDecodeStack, use_kernel_elementwise, use_kernel_linears
from pdserve.engine.models.llama import LlamaModel, load_hf_weights, rotary_tables
from pdserve.engine.quantization import quantize_linears
from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Owns the model weights, the KV caches (which each step mutates) and per-request seeds.
    The KV cache tensor comes from `kv_storage`, which the engine's caller chose."""

    def __init__(
        self, config: EngineConfig, model_path: Path, hf_config: PretrainedConfig, kv_storage: KvCacheStorage
    ) -> None:
        architectures = set(hf_config.architectures or [])
        if not architectures & SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {hf_config.architectures}; pdserve runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = DTYPES[config.kv_cache_dtype]
        self.block_size = config.cache.block_size
        check_backend_fits_device(config.attention_backend, self.device, self.block_size)
        self.model = self._load_model(config, model_path, hf_config)
        if self.device.type == "cpu":  # after the loaded checkpoint is gone: one copy at a time
            move_to_huge_pages(self.model)
        self.model.triton_ops = config.attention_backend == "triton"
        self.num_blocks = config.cache.num_blocks or self._num_blocks_for(self._kv_cache_bytes(config), hf_config)
        attn = self.model.layers[0].self_attn
        spec = KvCacheSpec(
            hf_config.num_hidden_layers, self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim,
            self.kv_dtype, config.device,
        )  # fmt: skip
        self.kv_caches = kv_caches_over(kv_storage.allocate(spec))
        self.decode_stack = (
            CpuDecodeStack(self.model, self.kv_caches)
            if config.attention_backend == "cpu" and CpuDecodeStack.supports(self.model, self.device, self.dtype)
            else None
        )
        if self.decode_stack is not None:
            # Prefill chunks' float32 products, norms and activations go through the kernels too.
            use_kernel_linears(self.model)
            use_kernel_elementwise(self.model)
        self.decode_graphs = self._capture_decode_graphs(config, hf_config)
        self.sampler = Sampler()
        self.seed_generator = torch.Generator().manual_seed(config.seed)
        self.seeds: dict[str, int] = {}  # request id -> its seed, drawn here for unseeded requests
        logger.info(
            "model loaded from %s; KV cache: %d blocks of %d tokens (%s)",
            model_path, self.num_blocks, self.block_size, config.kv_cache_dtype,
        )  # fmt: skip

    def _load_model(self, config: EngineConfig, model_path: Path, hf_config: PretrainedConfig) -> LlamaModel:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        backend = get_attention_backend(
            config.attention_backend, hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim
        )
        with torch.device("meta"):
            model = LlamaModel(hf_config, backend)
        model = model.to_empty(device=self.device)
        # Built on the meta device (no random init of weights about to be overwritten), so
        # the rotary tables computed at init hold nothing: compute them for real.
        model.cos_table, model.sin_table = (t.to(self.device) for t in rotary_tables(hf_config))
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(model_path.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if not tensors:
            raise ValueError(f"no *.safetensors weights in {model_path}")
        load_hf_weights(model, tensors)
        model = model.to(self.dtype).eval()
        quantize_linears(model, config.quantization)
        return model

    def _capture_decode_graphs(self, config: EngineConfig, hf_config: PretrainedConfig):
        """CUDA graphs of pure-decode steps (pdserve/engine/cuda_graphs.py), or None: on CPU, with
        another backend (their metadata is not static), or with --enforce-eager."""
        if self.device.type != "cuda" or config.attention_backend != "triton" or config.enforce_eager:
            return None
        from pdserve.engine.cuda_graphs import DecodeGraphs

        max_context_len = min(hf_config.max_position_embeddings, self.num_blocks * self.block_size)
        graphs = DecodeGraphs(
            self.model, self.kv_caches, config.scheduler.max_num_seqs, max_context_len, self.block_size
        )
        graphs.capture()
        logger.info("captured CUDA graphs for decode batches of %s sequences", graphs.buckets)
        return graphs

    def _kv_cache_bytes(self, config: EngineConfig) -> int:
        """On CPU, what --kv-cache-gib says; on CUDA, the engine's share of the GPU's memory
        less what is used already (weights, other processes) and the activations' headroom."""
        if self.device.type != "cuda":
            return config.cache.kv_cache_memory_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1 - config.cache.gpu_memory_utilization) * total - self._activation_bytes(config)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free after "
                f"loading the model; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return int(budget)

    def _activation_bytes(self, config: EngineConfig) -> int:
        """A bound on one step's activations: a few hidden-sized and intermediate-sized rows per
        token (the MLP's gate and up outputs are the largest), and float32 logits per sampled row."""
        hf = self.model.config
        element = torch.empty((), dtype=self.dtype).element_size()
        per_token = (6 * hf.hidden_size + 3 * hf.intermediate_size) * element
        logits = 3 * config.scheduler.max_num_seqs * hf.vocab_size * 4
        return 2 * config.scheduler.max_num_batched_tokens * per_token + logits

    def _num_blocks_for(self, memory_bytes: int, hf_config: PretrainedConfig) -> int:
        attn = self.model.layers[0].self_attn
        per_block = bytes_per_block(
            hf_config.num_hidden_layers, self.block_size, attn.num_kv_heads, attn.head_dim, self.kv_dtype
        )
        return max(1, memory_bytes // per_block)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], after_layer=None
    ) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Runs the step; returns request id -> (next token, its logprob) for sequences that completed.
        `after_layer(i)` is called as soon as layer i's K/V are written."""
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
        input_ids, positions, slots, logits_index, sampled = self._flatten(ordered)
        all_decode = all(s.num_new_tokens == 1 for s in ordered)
        stack_step = self._decode_stack_runs(ordered, all_decode, after_layer)
        if stack_step:
            every_logits = self._run_decode_stack(ordered, input_ids, positions, slots)
        else:
            hidden = self._run_model(ordered, input_ids, positions, slots, all_decode, after_layer)
        if not sampled:
            return {}
        # Only rows that end their sequence sample (a prompt's one-token chunk may not).
        logits = _rows(every_logits, logits_index) if stack_step else self._compute_logits(_rows(hidden, logits_index))
        params = [s.request.sampling_params for s in sampled]
        seeds = [self._seed(s.request.request_id, s.request.sampling_params.seed) for s in sampled]
        # The index of the token each row samples, counting outputs sent before a resumed stream began.
        positions = [s.request.sampling_params.num_prior_output_tokens + s.request.num_output_tokens for s in sampled]
        out = self.sampler(logits, params, seeds, positions)
        return {s.request.request_id: (tok, lp) for s, tok, lp in zip(sampled, out.token_ids, out.logprobs)}

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of these rows: by the decode stack's kernels where there is one."""
        head_owner = self.decode_stack if self.decode_stack is not None else self.model
        return head_owner.compute_logits(hidden)

    def _run_model(self, ordered, input_ids, positions, slots, all_decode: bool, after_layer) -> torch.Tensor:
        """Hidden states of every token of the step: from a CUDA graph or the model."""
        graphs = self.decode_graphs
        if graphs is not None and all_decode and after_layer is None and len(ordered) <= graphs.max_batch:
            context_lens = [s.start_position + 1 for s in ordered]
            return graphs.run(input_ids, positions, slots, [s.block_ids for s in ordered], context_lens)
        layout = BatchLayout(
            query_lens=[s.num_new_tokens for s in ordered],
            context_lens=[s.start_position + s.num_new_tokens for s in ordered],
            block_tables=[s.block_ids for s in ordered],
            num_decodes=sum(1 for s in ordered if s.num_new_tokens == 1),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_size=self.block_size,
        )
        metadata = self.model.layers[0].self_attn.backend.prepare(layout)
        input_ids, positions = (torch.tensor(values, device=self.device) for values in (input_ids, positions))
        return self.model(input_ids, positions, self.kv_caches, metadata, after_layer)

    def _decode_stack_runs(self, ordered: list[ScheduledRequest], all_decode: bool, after_layer) -> bool:
        """Whether this step goes through the C++ decode stack: every sequence decodes one token,
        no more than its kernels' row limit, and no caller waits on individual layers."""
        return (
            self.decode_stack is not None
            and after_layer is None
            and all_decode
            and len(ordered) <= self.decode_stack.max_batch
        )

    def _run_decode_stack(self, ordered: list[ScheduledRequest], input_ids, positions, slots) -> torch.Tensor:
        """The C++ decode stack's step, to the logits of every sequence, its int64 inputs made as
        one tensor: each torch.tensor and the attention backend's metadata (a mask the stack does
        not read) cost ~10 us apiece, a step's ~1-2% at batch 1."""
        num_seqs = len(ordered)
        context_lens = [s.start_position + 1 for s in ordered]
        table = padded_block_tables([s.block_ids for s in ordered], context_lens, self.block_size)
        flat = torch.tensor(input_ids + positions + slots + context_lens + [b for row in table for b in row])
        ids, token_positions, token_slots, lens = flat[: 4 * num_seqs].view(4, num_seqs)
        block_tables = flat[4 * num_seqs :].view(num_seqs, len(table[0]))
        return self.decode_stack.logits(ids, token_positions, token_slots, block_tables, lens)

    def _flatten(self, ordered: list[ScheduledRequest]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        sampled: list[ScheduledRequest] = []
        bs = self.block_size
        for s in ordered:
            start, end = s.start_position, s.start_position + s.num_new_tokens
            input_ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if s.completes_sequence:
                logits_index.append(len(input_ids) - 1)
                sampled.append(s)
        return input_ids, positions, slots, logits_index, sampled

    def _seed(self, request_id: str, seed: int | None) -> int:
        if seed is not None:
            return seed
        if request_id not in self.seeds:
            self.seeds[request_id] = int(torch.randint(0, 2**62, (1,), generator=self.seed_generator))
        return self.seeds[request_id]

    def release(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)


def _rows(values: torch.Tensor, index: list[int]) -> torch.Tensor:
    """values[index] for increasing row indices; as many as the rows means every row (a decode step's case)."""
    return values if len(index) == values.shape[0] else values[torch.tensor(index, device=values.device)]


def check_backend_fits_device(backend: str, device: torch.device, block_size: int) -> None:
    """Refuses the triton backend where its kernels cannot run: on CPU they run only in
    Triton's interpreter (the tests), far too slowly to serve."""
    if backend != "triton":
        return
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--attention-backend triton runs on CUDA (--device cuda), not {device}; on CPU use torch or cpu"
        )
    if block_size < 16:
        raise ValueError(f"--attention-backend triton needs --block-size 16 or more (tl.dot tiles), got {block_size}")
