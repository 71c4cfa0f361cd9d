"""BlockPool: free-queue order, ref counts, the prefix cache and eviction, with exact block ids."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_block_queue)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_initial_free_queue_is_in_id_order():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_get_new_blocks_takes_from_the_front():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3, 4]
    assert ids(pool.get_new_blocks(1)) == [3]


def test_get_new_blocks_returns_none_when_short_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    assert pool.get_new_blocks(3) is None
    assert free_ids(pool) == [2, 3]
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert pool.get_new_blocks(1) is None
    assert pool.get_new_blocks(0) == []


def test_free_blocks_appends_to_the_back_in_the_given_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 0 1 2 3; free: 4 5
    pool.free_blocks([blocks[2], blocks[0]])
    assert free_ids(pool) == [4, 5, 2, 0]
    assert blocks[2].ref_cnt == 0
    # Reuse follows the queue: the never-used blocks first, then the least recently freed.
    assert ids(pool.get_new_blocks(3)) == [4, 5, 2]


def test_block_with_other_references_is_not_freed():
    pool = BlockPool(3)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [1, 2]
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 2, 0]


def test_cached_free_block_is_found_by_hash_and_touch_takes_it_out_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[1], b"h1")
    pool.free_blocks(list(reversed(blocks)))
    assert free_ids(pool) == [2, 3, 1, 0]

    cached = pool.get_cached_block(b"h1")
    assert cached is blocks[1]
    assert cached.ref_cnt == 0 and cached.block_hash == b"h1"
    assert pool.get_cached_block(b"unknown") is None

    pool.touch([cached])
    assert cached.ref_cnt == 1
    assert free_ids(pool) == [2, 3, 0]
    assert pool.get_cached_block(b"h1") is cached  # still cached while in use
    assert pool.num_evictions == 0


def test_reusing_a_cached_free_block_evicts_it():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], b"h0")
    pool.cache_full_block(blocks[1], b"h1")
    pool.free_blocks(blocks)  # 0 then 1: block 0 is evicted first
    assert free_ids(pool) == [0, 1]

    [reused] = pool.get_new_blocks(1)
    assert reused.block_id == 0
    assert reused.block_hash is None
    assert pool.get_cached_block(b"h0") is None
    assert pool.get_cached_block(b"h1") is blocks[1]
    assert pool.num_evictions == 1
    assert pool.block_hash_to_block == {b"h1": blocks[1]}


def test_reusing_a_plain_free_block_is_no_eviction():
    pool = BlockPool(2)
    pool.free_blocks(pool.get_new_blocks(2))
    pool.get_new_blocks(2)
    assert pool.num_evictions == 0


def test_cache_full_block_keeps_the_first_copy_of_a_hash():
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, b"same")
    pool.cache_full_block(second, b"same")
    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None

    # Freeing and reusing the duplicate does not disturb the cached copy.
    pool.free_blocks([second])
    assert pool.get_new_blocks(2)[1] is second
    assert pool.get_cached_block(b"same") is first
    assert pool.num_evictions == 0


def test_cache_full_block_never_rehashes_a_block():
    pool = BlockPool(1)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"a")
    pool.cache_full_block(block, b"b")
    assert block.block_hash == b"a"
    assert pool.block_hash_to_block == {b"a": block}


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h")
    assert block.block_hash is None
    assert pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(3)
    in_use, freed = pool.get_new_blocks(2)
    pool.cache_full_block(in_use, b"a")
    pool.cache_full_block(freed, b"b")
    pool.free_blocks([freed])
    pool.reset_prefix_cache()
    assert pool.block_hash_to_block == {}
    assert in_use.block_hash is None and freed.block_hash is None
    assert in_use.ref_cnt == 1
    assert free_ids(pool) == [2, 1]
    pool.get_new_blocks(2)
    assert pool.num_evictions == 0


def test_changes_are_recorded_only_once_tracking_starts_and_the_last_change_wins():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, b"h-a")
    assert pool.drain_changes() == ([], [])  # not tracking yet
    assert pool.track_changes() == [b"h-a"]  # the snapshot to publish first
    pool.cache_full_block(b, b"h-b")
    pool.cache_full_block(c, b"h-c")
    pool.free_blocks([c, b, a])
    pool.get_new_blocks(1)  # evicts c, the first freed
    assert pool.drain_changes() == ([b"h-b"], [b"h-c"])
    assert pool.drain_changes() == ([], [])
    pool.get_new_blocks(1)  # evicts b: stored then removed within one drain nets out as removed
    pool.reset_prefix_cache()
    assert sorted(pool.drain_changes()[1]) == [b"h-a", b"h-b"]
