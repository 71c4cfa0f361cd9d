"""Maps requests to KV cache blocks: prefix matching, slot allocation, freeing.

    request tokens:   [ cached prefix | computed | new this step ]
    blocks:           [ b7 b2 ...     | b5       | b9 (fresh)    ]
                       matched via     allocated  allocated by
                       match_prefix    earlier    allocate_slots

Running out of blocks is a normal outcome: `allocate_slots` returns None and the scheduler
decides whom to preempt.
"""

from __future__ import annotations

from pdserve.engine.block_hash import hash_token_blocks
from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Mutates the block pool and `request.block_hashes`; owns `req_to_blocks`."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, extra_key: str = "") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0  # in tokens

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.block_pool.num_blocks

    def match_prefix(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks, and its token count.

        At least one token is always left to compute (its logits give the next token), so a
        fully cached prompt gives back its last block.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        cache_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Gives the request blocks for `num_new_tokens` more tokens after its computed ones
        (and after `new_computed_blocks`, a prefix-cache hit being adopted). None if the pool
        cannot serve it; nothing changes then. `cache_blocks=False` keeps the new blocks out of
        the prefix cache (their contents arrive later from another node)."""
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Adopting a cached block that sits in the free queue also takes it out of the pool.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.num_free_blocks:
            return None
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request.request_id] = req_blocks
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        assert new_blocks is not None
        req_blocks.extend(new_blocks)
        if cache_blocks:
            self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Enters the request's full, computed blocks in the prefix cache."""
        self._cache_full_blocks(request, self.req_to_blocks.get(request.request_id, []), request.num_computed_tokens)

    def record_prefix_query(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Counts one admitted request's prompt for the prefix-cache hit rate."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_cached_tokens

    def free(self, request: Request) -> None:
        """Releases the request's blocks; tail blocks first so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _update_block_hashes(self, request: Request) -> None:
        if request.num_tokens // self.block_size > len(request.block_hashes):
            request.block_hashes = hash_token_blocks(
                request.all_token_ids, self.block_size, self.extra_key, request.block_hashes
            )

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Registers blocks that are full once this step's tokens are computed."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.req_to_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i])
        self.req_to_num_cached_blocks[request.request_id] = num_full
