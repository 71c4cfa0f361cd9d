"""The engine loop: add requests, step, read outputs.

Lifecycle of a step:
  1. the scheduler picks running decodes, then prefill chunks, within the token budget
     (preempting the newest request if KV blocks run out);
  2. the model runner does one forward pass over the flat batch and samples;
  3. each completed sequence gets its token; finished requests free their blocks at once.
The services drive `add_request` / `step` / `abort` from their own threads; `generate` runs
the loop offline until every request is done.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KvCacheStorage, LocalKvCacheStorage
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_loader import resolve_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, RequestOutput, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import EngineLoad, Reservation, Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvCacheChanges:
    stored: list[bytes]
    removed: list[bytes]
    full: bool  # stored is everything cached: drop what was known before


@dataclass(frozen=True)
class HeldPrompt:
    """A held request (`hold_kv`) whose prompt completes in this step, and its KV blocks in order."""

    request_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class EngineCounters:
    """The engine's counters since start (plain ints, readable from any thread between steps)."""

    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int


# Called on the engine thread as soon as a layer of a step is computed, with the held prompts
# that complete in that step: a prefill node pushes that layer's pages while the rest runs.
LayerHook = Callable[[int, list[HeldPrompt]], None]


class LLMEngine:
    """Owns the model runner, KV cache manager and scheduler; mutates requests as they run.

    The caller chooses where the KV cache lives (`kv_storage`, local memory by default) and may
    pass a `layer_hook` that sees each layer of a step that completes held prompts."""

    def __init__(
        self, config: EngineConfig, kv_storage: KvCacheStorage | None = None, layer_hook: LayerHook | None = None
    ) -> None:
        self.config = config
        resolved = resolve_model(config.model)
        self.model_path = resolved.path
        self.served_model_name = resolved.served_name
        self.tokenizer = _load_tokenizer(self.model_path)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.max_model_len = hf_config.max_position_embeddings
        self.eos_token_ids = _eos_token_ids(hf_config, self.tokenizer)
        self.model_runner = ModelRunner(config, self.model_path, hf_config, kv_storage or LocalKvCacheStorage())
        self.kv_cache_manager = KVCacheManager(
            self.model_runner.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            extra_key=self.served_model_name,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self._request_counter = itertools.count()
        self.layer_hook = layer_hook

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) views of the paged cache: what KV transfer reads and writes."""
        return self.model_runner.kv_caches

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, hold_kv: bool = False
    ) -> Request:
        """Queues a request; raises ValueError for a prompt the model or the cache cannot hold.
        `hold_kv` keeps its blocks after it finishes, until `release_kv` (a prefill node's pages)."""
        request = self._new_request(request_id, prompt_token_ids, sampling_params)
        request.hold_kv = hold_kv
        self.scheduler.add_request(request)
        return request

    def reserve_prefilled(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> Reservation | None:
        """Decode node: holds blocks for a prompt computed elsewhere, reusing the leading blocks
        already in this node's prefix cache; None if the pool is full."""
        return self.scheduler.reserve(self._new_request(request_id, prompt_token_ids, sampling_params))

    def kv_cache_changes(self, full: bool) -> KvCacheChanges:
        """Prefix-cache hashes stored and evicted since the last call (what the cluster's KV
        index needs); `full` restarts from a snapshot of everything cached now."""
        pool = self.kv_cache_manager.block_pool
        if full:
            return KvCacheChanges(stored=pool.track_changes(), removed=[], full=True)
        stored, removed = pool.drain_changes()
        return KvCacheChanges(stored, removed, full=False)

    def admit_prefilled(self, request_id: str, first_token_id: int, logprob=None) -> RequestOutput | None:
        """Decode node: the pages arrived; the request decodes from the next step on. Returns a
        final output if the first token already ends it."""
        request = self.scheduler.admit_prefilled(request_id, first_token_id, logprob)
        if request.check_stop():
            self.scheduler.finish(request, request.status)
            return _step_output(request, first_token_id, logprob)
        return None

    def release_kv(self, request_id: str) -> None:
        """Prefill node: the held pages were sent (or the transfer failed): free the blocks."""
        self.scheduler.release_held(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv_cache_manager.get_block_ids(request_id)

    def _new_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> Request:
        if len(prompt_token_ids) + sampling_params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling_params.max_tokens}) "
                f"exceeds the model's context length {self.max_model_len}"
            )
        vocab_size = self.model_runner.model.config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
        return Request(request_id, prompt_token_ids, sampling_params, self.eos_token_ids)

    def abort(self, request_id: str) -> None:
        """Ends the request wherever it is (waiting, running, reserved, prefilled, or finished with
        its blocks held) and frees its blocks; a no-op for an id the engine does not know."""
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.model_runner.release(request_id)
        self.scheduler.release_held(request_id)

    def load(self) -> EngineLoad:
        """What the node reports to the registry (read on the engine thread)."""
        return self.scheduler.load()

    def counters(self) -> EngineCounters:
        """What a node's metrics count (int reads: a scrape may lag a step, never tear)."""
        cache = self.kv_cache_manager
        return EngineCounters(cache.num_prefix_queries, cache.num_prefix_hits, self.scheduler.num_preemptions)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass; outputs for requests that got a token."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        samples = self.model_runner.execute(scheduler_output.scheduled, self._layer_hook(scheduler_output.scheduled))
        outputs = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            request.num_computed_tokens += scheduled.num_new_tokens
            if request.request_id not in samples:
                continue  # a prefill chunk that did not reach the end of the prompt
            token_id, logprob = samples[request.request_id]
            request.append_token(token_id, logprob)
            if request.check_stop():
                self.scheduler.finish(request, request.status, hold_kv=request.hold_kv)
                self.model_runner.release(request.request_id)
            outputs.append(_step_output(request, token_id, logprob))
        return outputs

    def _layer_hook(self, scheduled) -> Callable[[int], None] | None:
        if self.layer_hook is None:
            return None
        held = [
            HeldPrompt(s.request.request_id, s.block_ids)
            for s in scheduled
            if s.completes_sequence and s.request.hold_kv
        ]
        if not held:
            return None
        return lambda layer: self.layer_hook(layer, held)

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (batched); results in input order."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        ids = [f"generate-{next(self._request_counter)}" for _ in prompts]
        requests = [self.add_request(i, p, sp) for i, p, sp in zip(ids, prompts, sampling_params)]
        while self.has_unfinished_requests:
            self.step()
        return [_final_output(r) for r in requests]


def _load_tokenizer(folder):
    """The folder's tokenizer, or None for a weights-only folder (token ids in, token ids out)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((folder / name).exists() for name in names):
        return None
    return AutoTokenizer.from_pretrained(folder)


def _eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def _output(
    request: Request, new_token_ids: list[int], new_logprobs: list, with_history: bool = False
) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=new_logprobs,
        finished=request.is_finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        token_ids=request.output_token_ids if with_history else [],
        logprobs=request.output_logprobs if with_history else [],
    )


def _step_output(request: Request, token_id: int, logprob) -> RequestOutput:
    return _output(request, [token_id], [logprob] if logprob is not None else [])


def _final_output(request: Request) -> RequestOutput:
    return _output(request, [], [], with_history=True)
