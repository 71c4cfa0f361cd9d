"""Fixed pool of KV cache blocks with reference counts and an LRU prefix cache.

A block is in exactly one of three states:
    in use      ref_cnt > 0, not in the free queue
    cached free ref_cnt == 0, in the free queue, still findable through block_hash_to_block
    free        ref_cnt == 0, in the free queue, no hash
New blocks are taken from the front of the free queue; a cached block taken this way is
evicted (its hash forgotten). Freed blocks go to the back, so the least recently freed block
is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Owns every block. Mutates ref counts, the free queue and `block_hash_to_block`."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        # hash -> True (now cached) / False (evicted) since the last drain; None: not tracked.
        self._changed_hashes: dict[bytes, bool] | None = None

    def track_changes(self) -> list[bytes]:
        """Starts (or restarts) recording prefix-cache changes; returns every hash cached now."""
        self._changed_hashes = {}
        return list(self.block_hash_to_block)

    def drain_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) hashes since the last drain; a hash's last change wins."""
        if self._changed_hashes is None:
            return [], []
        changed, self._changed_hashes = self._changed_hashes, {}
        return [h for h, cached in changed.items() if cached], [h for h, cached in changed.items() if not cached]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Takes `num_blocks` from the front of the free queue (evicting cached ones); None if short."""
        if num_blocks > self.num_free_blocks:
            return None
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drops one reference per block; blocks reaching zero join the back of the free queue
        in the given order (first given = first evicted)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Makes a full block findable by its hash. If another block already holds the same
        content (two requests computed it at once), the first one stays the cached copy."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.block_hash_to_block:
            return
        block.block_hash = block_hash
        self.block_hash_to_block[block_hash] = block
        self._record(block_hash, True)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = None
        for block_hash in self.block_hash_to_block:
            self._record(block_hash, False)
        self.block_hash_to_block.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.block_hash_to_block.get(block.block_hash) is block:
            del self.block_hash_to_block[block.block_hash]
            self._record(block.block_hash, False)
        block.block_hash = None
        self.num_evictions += 1

    def _record(self, block_hash: bytes, cached: bool) -> None:
        if self._changed_hashes is not None:
            self._changed_hashes[block_hash] = cached
