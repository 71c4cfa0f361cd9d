"""Decides, each step, which requests run and how many tokens each computes.

Policy, visible in `schedule()`:
  1. running requests first, oldest first: decodes take one token each, a request in the
     middle of a chunked prefill takes what is left of the budget;
  2. when blocks run out, the newest running request is preempted (its blocks freed, to be
     recomputed later) until the older one fits;
  3. the remaining budget admits waiting requests in arrival order, reusing their cached
     prefix blocks; a prompt longer than the budget is split into chunks over several steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def start_position(self) -> int:
        return self.request.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes up to the last known token, so a next token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class Reservation:
    """A decode node's blocks for a prompt computed elsewhere: the first `num_cached_blocks`
    hold the prompt's leading blocks already (prefix-cache hit); `block_ids` are the rest,
    which the prefill node's pages must fill."""

    block_ids: list[int]
    num_cached_blocks: int


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is: what a node reports to the registry and the router reads."""

    num_waiting_tokens: int = 0  # prompt tokens not computed yet (waiting or mid-prefill)
    num_waiting_requests: int = 0  # in the waiting queue (new or preempted)
    num_running: int = 0  # sequences decoding, or prefilled and about to
    num_free_blocks: int = 0
    num_pending_transfers: int = 0  # decode: reserved blocks awaiting pages; prefill: pages held for a push


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and running list; mutates request status and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Disaggregated decode: requests whose prompt KV was pushed by a prefill node.
        self.reserved: dict[str, Request] = {}  # blocks held, pages still arriving
        self.prefilled: deque[Request] = deque()  # pages arrived, waiting for a running slot
        # Prefill node: finished requests whose blocks stay until their pages are sent.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0  # since start: a plain int the node's metrics read

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    def load(self) -> EngineLoad:
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        return EngineLoad(
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in [*self.waiting, *prefilling]),
            num_waiting_requests=len(self.waiting),
            num_running=len(self.running) + len(self.prefilled),
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_pending_transfers=len(self.reserved) + len(self.held),
        )

    def add_request(self, request: Request) -> None:
        self._check_new(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> Reservation | None:
        """Holds blocks for a prompt whose KV another node computes, adopting the leading blocks
        this node has cached; None if the pool is short for now (raises ValueError if it always
        will be). The new blocks are not entered in the prefix cache until their pages have arrived."""
        self._check_new(request)
        cached_blocks, num_cached_tokens = self.kv_cache_manager.match_prefix(request)
        num_new_tokens = request.num_prompt_tokens - num_cached_tokens
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, cached_blocks, cache_blocks=False)
        if new_blocks is None:
            return None
        self.kv_cache_manager.record_prefix_query(request.num_prompt_tokens, num_cached_tokens)
        request.num_cached_tokens = num_cached_tokens
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return Reservation([b.block_id for b in new_blocks], len(cached_blocks))

    def admit_prefilled(self, request_id: str, first_token_id: int, logprob=None) -> Request:
        """The pushed pages are in place: the request joins the batch at the next step."""
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_cache_manager.cache_computed_blocks(request)
        request.append_token(first_token_id, logprob)
        self.prefilled.append(request)
        return request

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        while self.prefilled and len(self.running) < self.config.max_num_seqs:
            request = self.prefilled.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted_ids:
            self._schedule_waiting(output, budget)
        return output

    def finish(self, request: Request, status: RequestStatus, hold_kv: bool = False) -> None:
        """Ends a request (stopped, length or aborted) and frees its blocks at once, unless
        `hold_kv`: then they stay until `release_held` (a prefill node sending its pages)."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.prefilled:
            self.prefilled.remove(request)
        self.reserved.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        if hold_kv:
            self.held[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)

    def release_held(self, request_id: str) -> None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    def _check_new(self, request: Request) -> None:
        """Raises ValueError for a reused id or a request that the whole cache could not hold
        (it would wait, or be preempted, forever)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        max_tokens = self.kv_cache_manager.block_pool.num_blocks * self.kv_cache_manager.block_size
        if request.num_prompt_tokens + request.sampling_params.max_tokens > max_tokens:
            raise ValueError(
                f"request {request.request_id!r} needs up to "
                f"{request.num_prompt_tokens + request.sampling_params.max_tokens} tokens of KV cache, "
                f"more than the whole cache holds ({max_tokens}); shorten the prompt or max_tokens"
            )

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, output):
                break  # the request itself was the newest and got preempted
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached_blocks, num_cached = self.kv_cache_manager.match_prefix(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, cached_blocks) is None:
                break  # first come, first served: later requests wait behind this one
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
                self.kv_cache_manager.record_prefix_query(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _scheduled(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        return ScheduledRequest(request, num_new_tokens, self.kv_cache_manager.get_block_ids(request.request_id))
