"""KVCacheManager: exact block ids per request, prefix matching, freeing order, eviction."""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from tests.factories import make_request

BLOCK_SIZE = 4


def free_ids(manager: KVCacheManager) -> list[int]:
    return list(manager.block_pool.free_block_queue)


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in manager.block_pool.blocks]


def schedule_prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request: match its prefix, allocate the rest, mark it computed."""
    cached_blocks, num_cached = manager.match_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, cached_blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def test_new_request_gets_exact_blocks_from_the_front():
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(35)))
    new_blocks = manager.allocate_slots(request, 35)
    assert [b.block_id for b in new_blocks] == list(range(9))
    assert manager.get_block_ids("a") == list(range(9))
    assert free_ids(manager) == [9, 10, 11]
    assert ref_cnts(manager) == [1] * 9 + [0] * 3


def test_full_blocks_are_cached_at_allocation_and_the_partial_one_is_not():
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(35)))
    manager.allocate_slots(request, 35)
    pool = manager.block_pool
    assert len(request.block_hashes) == 8
    assert [pool.get_cached_block(h).block_id for h in request.block_hashes] == list(range(8))
    assert pool.blocks[8].block_hash is None


def test_decode_fills_the_last_block_then_takes_a_new_one():
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(35)))
    manager.allocate_slots(request, 35)
    request.num_computed_tokens = 35

    request.append_token(500)  # token 36 fits in block 8
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens = 36
    assert manager.block_pool.blocks[8].block_hash == request.block_hashes[8]

    request.append_token(501)  # token 37 needs block 9
    assert [b.block_id for b in manager.allocate_slots(request, 1)] == [9]
    assert manager.get_block_ids("a") == list(range(10))


def test_chunked_prefill_allocates_block_by_block():
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(35)))
    ids_per_chunk = []
    for num_new in (16, 16, 3):
        ids_per_chunk.append([b.block_id for b in manager.allocate_slots(request, num_new)])
        request.num_computed_tokens += num_new
    assert ids_per_chunk == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    # A chunk ending mid-block caches only the blocks it completes.
    assert len(manager.block_pool.block_hash_to_block) == 8


def test_allocate_returns_none_and_changes_nothing_when_short():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    holder = make_request("holder", list(range(8)))
    manager.allocate_slots(holder, 8)  # blocks 0 1
    request = make_request("a", list(range(100, 109)))  # needs 3 blocks, 2 free

    assert manager.allocate_slots(request, 9) is None
    assert free_ids(manager) == [2, 3]
    assert ref_cnts(manager) == [1, 1, 0, 0]
    assert manager.get_block_ids("a") == []
    assert request.block_hashes == []
    assert len(manager.block_pool.block_hash_to_block) == 2

    # A running request that cannot grow keeps exactly what it had.
    holder.num_computed_tokens = 8
    holder.append_token(1)
    manager.allocate_slots(make_request("filler", [7] * 8), 8)  # blocks 2 3
    assert manager.allocate_slots(holder, 1) is None
    assert manager.get_block_ids("holder") == [0, 1]
    assert free_ids(manager) == []


def test_free_releases_tail_first():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    manager.allocate_slots(request, 10)  # 0 1 2
    manager.free(request)
    assert free_ids(manager) == [3, 4, 2, 1, 0]
    assert ref_cnts(manager) == [0] * 5
    assert manager.get_block_ids("a") == []
    # The tail is reused (evicted) before the shared-looking head of the prompt.
    assert [b.block_id for b in manager.allocate_slots(make_request("b", [9] * 12), 12)] == [3, 4, 2]


def test_match_prefix_finds_the_longest_cached_prefix_in_whole_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(16)))
    assert schedule_prefill(manager, first) == [0, 1, 2, 3]
    manager.free(first)

    diverges_in_block_2 = make_request("b", list(range(10)) + [99, 98, 97])
    blocks, num_cached = manager.match_prefix(diverges_in_block_2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert num_cached == 8

    longer = make_request("c", list(range(16)) + [50])
    blocks, num_cached = manager.match_prefix(longer)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    assert num_cached == 16

    differs_in_first_token = make_request("d", [1000] + list(range(1, 16)))
    assert manager.match_prefix(differs_in_first_token) == ([], 0)


def test_fully_cached_prompt_gives_back_its_last_block():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(16)))
    schedule_prefill(manager, first)
    manager.free(first)

    again = make_request("again", list(range(16)))
    blocks, num_cached = manager.match_prefix(again)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert num_cached == 12  # one block recomputed, so the last token's logits exist

    # A prompt shorter than one block matches nothing even when cached.
    assert manager.match_prefix(make_request("short", [0, 1, 2, 3])) == ([], 0)


def test_shared_prefix_shares_block_ids_and_counts_references():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    assert schedule_prefill(manager, a) == [0, 1, 2]

    b = make_request("b", list(range(8)) + [70, 71, 72])
    assert schedule_prefill(manager, b) == [0, 1, 3]
    assert b.num_computed_tokens == 11
    assert ref_cnts(manager) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert free_ids(manager) == [4, 5, 6, 7]

    manager.free(a)
    assert ref_cnts(manager)[:4] == [1, 1, 0, 1]
    assert free_ids(manager) == [4, 5, 6, 7, 2]
    manager.free(b)
    assert free_ids(manager) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_adopting_a_cached_free_block_takes_it_out_of_the_free_queue():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    schedule_prefill(manager, a)  # 0 1, both full and cached
    manager.free(a)
    assert free_ids(manager) == [2, 1, 0]

    # 16 tokens: 2 cached blocks + 2 new ones = 4 blocks taken from a free queue of 3.
    too_big = make_request("too-big", list(range(16)))
    blocks, num_cached = manager.match_prefix(too_big)
    assert num_cached == 8
    assert manager.allocate_slots(too_big, 8, blocks) is None
    assert free_ids(manager) == [2, 1, 0]
    assert ref_cnts(manager) == [0, 0, 0]
    assert manager.get_block_ids("too-big") == []

    fits = make_request("fits", list(range(12)))
    assert schedule_prefill(manager, fits) == [0, 1, 2]
    assert free_ids(manager) == []
    assert manager.block_pool.num_evictions == 0


def test_evicted_blocks_are_no_longer_matched():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    schedule_prefill(manager, a)  # 0 1 2; blocks 0 1 cached
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1, 0]

    # Takes 3, 2 and 1: block 1 (a's second block) is evicted, block 0 stays cached.
    other = make_request("other", [500] * 12)
    assert schedule_prefill(manager, other) == [3, 2, 1]
    assert manager.block_pool.num_evictions == 1

    blocks, num_cached = manager.match_prefix(make_request("a-again", list(range(9))))
    assert [b.block_id for b in blocks] == [0]
    assert num_cached == 4


def test_prefix_caching_disabled_matches_and_caches_nothing():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request("a", list(range(12)))
    manager.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    manager.free(a)
    assert manager.match_prefix(make_request("b", list(range(13)))) == ([], 0)
    assert manager.block_pool.block_hash_to_block == {}


def test_extra_key_goes_into_the_block_hashes():
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, extra_key="model-a").match_prefix(a)
    KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, extra_key="model-b").match_prefix(b)
    assert len(a.block_hashes) == len(b.block_hashes) == 2
    assert a.block_hashes[0] != b.block_hashes[0]


def test_prefix_hit_counters_count_recorded_admissions_in_tokens():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    schedule_prefill(manager, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    manager.match_prefix(b)
    manager.match_prefix(b)  # a request retried at the head of the queue is not counted twice
    assert (manager.num_prefix_queries, manager.num_prefix_hits) == (0, 0)
    manager.record_prefix_query(9, 0)
    manager.record_prefix_query(9, manager.match_prefix(b)[1])
    assert (manager.num_prefix_queries, manager.num_prefix_hits) == (18, 8)


def test_usage_is_the_fraction_of_blocks_not_free():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    assert manager.usage == 0.0
    manager.allocate_slots(make_request("a", list(range(5))), 5)
    assert manager.usage == 0.5
