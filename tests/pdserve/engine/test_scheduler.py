"""Scheduler policy on a tiny cache (block_size 4): decodes first, chunked prefill, limits, preemption."""

from __future__ import annotations

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from tests.factories import make_request

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64, max_num_seqs: int = 16) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        KVCacheManager(num_blocks, BLOCK_SIZE),
    )


def add(scheduler: Scheduler, request_id: str, num_tokens: int, first_token: int, max_tokens: int = 8):
    """Adds a request whose prompt is `num_tokens` consecutive ids (distinct ranges share no prefix)."""
    request = make_request(request_id, list(range(first_token, first_token + num_tokens)), max_tokens)
    scheduler.add_request(request)
    return request


def run_step(output: SchedulerOutput, token_id: int = 1) -> None:
    """What the engine does after the forward pass: advance computed tokens, sample for finished prefills."""
    for s in output.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.append_token(token_id)


def plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def test_new_requests_are_admitted_in_arrival_order():
    scheduler = make_scheduler()
    a = add(scheduler, "a", 5, 0)
    add(scheduler, "b", 3, 100)
    output = scheduler.schedule()
    assert plan(output) == [("a", 5), ("b", 3)]
    assert output.num_batched_tokens == 8
    assert [s.block_ids for s in output.scheduled] == [[0, 1], [2]]
    assert a.status == RequestStatus.RUNNING
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert not scheduler.waiting


def test_decodes_come_before_prefill_chunks_and_take_one_token_each():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, "a", 4, 0)
    add(scheduler, "b", 4, 100)
    run_step(scheduler.schedule())
    add(scheduler, "c", 20, 200)

    steps = []
    for _ in range(4):
        output = scheduler.schedule()
        steps.append(plan(output))
        run_step(output)
    assert steps == [
        [("a", 1), ("b", 1), ("c", 8)],
        [("a", 1), ("b", 1), ("c", 8)],
        [("a", 1), ("b", 1), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]


def test_long_prompt_is_split_into_chunks_over_steps():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = add(scheduler, "a", 20, 0)
    chunks = []
    for _ in range(4):
        output = scheduler.schedule()
        [s] = output.scheduled
        chunks.append((s.start_position, s.num_new_tokens, s.completes_sequence, s.block_ids))
        run_step(output)
    assert chunks == [
        (0, 8, False, [0, 1]),
        (8, 8, False, [0, 1, 2, 3]),
        (16, 4, True, [0, 1, 2, 3, 4]),
        (20, 1, True, [0, 1, 2, 3, 4, 5]),
    ]
    assert request.num_output_tokens == 2


def test_running_chunked_prefill_keeps_the_budget_before_waiting_requests():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "long", 12, 0)
    run_step(scheduler.schedule())  # long: 8 of 12
    add(scheduler, "short", 6, 100)
    output = scheduler.schedule()
    assert plan(output) == [("long", 4), ("short", 4)]  # the newcomer gets only what is left


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(max_num_seqs=2)
    a = add(scheduler, "a", 4, 0)
    add(scheduler, "b", 4, 100)
    add(scheduler, "c", 4, 200)
    output = scheduler.schedule()
    assert plan(output) == [("a", 4), ("b", 4)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    run_step(output)

    assert plan(scheduler.schedule()) == [("a", 1), ("b", 1)]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    assert plan(scheduler.schedule()) == [("b", 1), ("c", 4)]


def test_waiting_requests_are_first_come_first_served_when_blocks_run_short():
    scheduler = make_scheduler(num_blocks=4)
    add(scheduler, "a", 8, 0)  # blocks 0 1
    add(scheduler, "big", 12, 100, max_tokens=4)  # needs 3 blocks, 2 left
    add(scheduler, "small", 4, 200)  # would fit, but waits behind "big"
    output = scheduler.schedule()
    assert plan(output) == [("a", 8)]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    assert scheduler.kv_cache_manager.get_block_ids("big") == []


def test_newest_running_request_is_preempted_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=4)
    old = add(scheduler, "old", 8, 0)  # blocks 0 1
    new = add(scheduler, "new", 6, 100)  # blocks 2 3
    run_step(scheduler.schedule())  # old: 9 tokens, new: 7 tokens
    late = add(scheduler, "late", 4, 200)  # no block free: waits

    output = scheduler.schedule()  # old needs a third block
    assert output.preempted_ids == ["new"]
    assert plan(output) == [("old", 1)]
    assert new.status == RequestStatus.WAITING
    assert new.num_computed_tokens == 0
    assert new.num_preemptions == 1
    assert scheduler.num_preemptions == 1  # the node's counter
    assert list(scheduler.waiting) == [new, late]
    assert scheduler.running == [old]
    assert scheduler.kv_cache_manager.get_block_ids("new") == []
    # new's blocks were freed tail first, so the tail block 3 went to old.
    assert scheduler.kv_cache_manager.get_block_ids("old") == [0, 1, 3]
    assert list(scheduler.kv_cache_manager.block_pool.free_block_queue) == [2]


def test_request_that_cannot_grow_and_is_newest_preempts_itself():
    scheduler = make_scheduler(num_blocks=4)
    add(scheduler, "old", 6, 0)  # blocks 0 1, room for 2 more tokens
    add(scheduler, "new", 8, 100)  # blocks 2 3, full
    run_step(scheduler.schedule())

    output = scheduler.schedule()
    assert plan(output) == [("old", 1)]
    assert output.preempted_ids == ["new"]
    assert [r.request_id for r in scheduler.waiting] == ["new"]
    assert scheduler.kv_cache_manager.num_free_blocks == 2


def test_preempted_request_is_recomputed_with_its_output_tokens():
    scheduler = make_scheduler(num_blocks=4)
    old = add(scheduler, "old", 6, 0)
    new = add(scheduler, "new", 8, 100)
    run_step(scheduler.schedule())
    run_step(scheduler.schedule())  # new preempted; old: 8 tokens
    scheduler.finish(old, RequestStatus.FINISHED_STOPPED)

    # Its 9 tokens (8 prompt + 1 output) are due again; its two full blocks survived in the
    # prefix cache (free queue 3 2 1 0), so only the last token is recomputed, in block 1.
    output = scheduler.schedule()
    [s] = output.scheduled
    assert s.request is new
    assert (s.start_position, s.num_new_tokens, s.block_ids) == (8, 1, [2, 3, 1])
    assert s.completes_sequence
    assert new.status == RequestStatus.RUNNING
    assert new.num_cached_tokens == 0  # counted at its first schedule only


def test_second_request_reuses_the_cached_prefix():
    scheduler = make_scheduler()
    add(scheduler, "a", 10, 0)
    run_step(scheduler.schedule())
    b = make_request("b", list(range(9)) + [77, 78])
    scheduler.add_request(b)
    output = scheduler.schedule()
    assert plan(output) == [("a", 1), ("b", 3)]
    assert output.scheduled[1].block_ids == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert b.num_computed_tokens == 8


def test_add_request_rejects_a_request_bigger_than_the_whole_cache():
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots
    add(scheduler, "fits", 8, 0, max_tokens=8)
    with pytest.raises(ValueError, match="more than the whole cache"):
        add(scheduler, "too-big", 8, 100, max_tokens=9)
    assert "too-big" not in scheduler.requests
    assert [r.request_id for r in scheduler.waiting] == ["fits"]


def test_reserve_refuses_for_now_when_short_and_for_good_when_the_whole_cache_is_too_small():
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots
    assert scheduler.reserve(make_request("a", list(range(8)), max_tokens=4)).block_ids == [0, 1]
    assert scheduler.reserve(make_request("short", list(range(100, 112)), max_tokens=4)) is None  # 3 > 2 free
    assert "short" not in scheduler.requests and scheduler.kv_cache_manager.num_free_blocks == 2
    with pytest.raises(ValueError, match="more than the whole cache"):  # it would wait forever
        scheduler.reserve(make_request("never", list(range(200, 212)), max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.reserve(make_request("a", list(range(300, 304))))
    assert list(scheduler.reserved) == ["a"] and scheduler.load().num_pending_transfers == 1


def test_add_request_rejects_a_duplicate_id():
    scheduler = make_scheduler()
    add(scheduler, "a", 4, 0)
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", 4, 100)
    assert len(scheduler.waiting) == 1


def test_finish_frees_blocks_and_forgets_the_request():
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    a = add(scheduler, "a", 8, 0)
    waiting = add(scheduler, "w", 4, 100, max_tokens=4)
    run_step(scheduler.schedule())  # only "a" fits the budget
    assert [r.request_id for r in scheduler.waiting] == ["w"]
    scheduler.finish(a, RequestStatus.FINISHED_LENGTH)
    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.is_finished
    assert waiting.finish_reason == "abort"
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests
    assert scheduler.requests == {}
    assert scheduler.schedule().is_empty
