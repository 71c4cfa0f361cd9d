"""The cluster's KV location index in Redis: which node holds which prefix-cache blocks.

Each node incarnation owns one Redis set, `pdserve:kv:{node_id}:{incarnation}`, of the chained
block hashes (16 bytes, `pdserve.engine.block_hash`) in its prefix cache.

Node side (`KvIndexPublisher`), every `interval_s`:
  1. apply the prefix-cache changes the engine has drained since the last flush, all in one
     pipeline: SADD stored, SREM removed;
  2. refresh the set's TTL (`ttl_s`, the registry's) with the changes, and, whatever the engine
     is doing, at least every third of the TTL: a flush with nothing to send and a TTL that is
     still fresh skips Redis (at 10 flushes a second, the round trips took a third of the CPU
     of the RPC thread that streams tokens beside the engine);
  3. the first flush, any flush after a failed one, and any flush that finds the set gone
     (Redis restarted, or the set expired) write a full snapshot instead: changes drained
     while Redis was away are lost, so the index is rebuilt from what the node holds.
A node that dies stops refreshing and its set expires `ttl_s` later. A restarted node is a
new incarnation with a new set, and the gateway reads only the sets of incarnations the
registry lists now, so no entry of the old one is ever used, even before it expires.

Gateway side (`KvIndexReader`): for a prompt's block hashes and the candidate nodes, the
number of leading blocks each node holds, in one round trip (SMISMEMBER per node, pipelined).
While Redis fails it answers {} at once (routing falls back to load) and retries later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from redis import RedisError

from pdserve.cluster_state.registry import FailureStreak, NodeInfo, Periodic, redis_client

logger = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:kv:"
DEFAULT_FLUSH_S = 0.1


def kv_index_key(node_id: str, incarnation: str) -> str:
    return f"{KEY_PREFIX}{node_id}:{incarnation}"


# engine.llm_engine.KvCacheChanges, fetched from the engine thread
ChangesFn = Callable[[bool], Awaitable[object]]


class KvIndexPublisher:
    """Mirrors one node's prefix cache into its Redis set. Never raises on Redis errors."""

    def __init__(
        self, redis_url: str, node: NodeInfo, changes_fn: ChangesFn, ttl_s: float, interval_s: float = DEFAULT_FLUSH_S
    ):
        self.key = kv_index_key(node.node_id, node.incarnation)
        self.ttl_ms = int(ttl_s * 1000)
        self._changes_fn = changes_fn
        self._client = redis_client(redis_url)
        self._failures = FailureStreak(f"KV index of node {node.node_id}")
        self._needs_full = True
        self._pending: asyncio.Future | None = None  # a drain waiting for the engine's step to end
        self._flusher = Periodic(self.flush, interval_s, f"kv-index-{node.node_id}")
        self._ttl_refresh_s = ttl_s / 3
        self._ttl_refreshed_at = -float("inf")

    async def start(self) -> None:
        await self.flush()
        self._flusher.start()

    async def stop(self) -> None:
        await self._flusher.stop()
        try:
            await self._client.delete(self.key)
        except (RedisError, OSError) as error:
            logger.warning("could not delete %s (%s); it expires on its own", self.key, error)
        finally:
            await self._client.aclose()

    async def flush(self) -> None:
        changes = await self._drained_changes()
        has_changes = _has_changes(changes)
        now = time.monotonic()
        if not has_changes and now - self._ttl_refreshed_at < self._ttl_refresh_s:
            return
        pipeline = self._client.pipeline(transaction=has_changes and changes.full)
        pipeline.pexpire(self.key, self.ttl_ms)
        if has_changes:
            _apply(pipeline, self.key, changes)
            pipeline.pexpire(self.key, self.ttl_ms)
        try:
            set_was_there = (await pipeline.execute())[0]
        except (RedisError, OSError) as error:
            self._failures.failed(error)
            self._needs_full = changes is not None or self._needs_full  # drained changes are lost
            return
        self._failures.succeeded()
        self._ttl_refreshed_at = now
        if changes is not None and changes.full:
            self._needs_full = False
        elif not set_was_there:
            self._needs_full = True  # Redis lost the set (or it was empty): rebuild it next time

    async def _drained_changes(self):
        """The engine's changes if a drain has finished; None while it waits for a long step."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._changes_fn(self._needs_full))
        if not self._pending.done():
            await asyncio.wait({self._pending}, timeout=0.01)
            if not self._pending.done():
                return None
        pending, self._pending = self._pending, None
        return pending.result()


def _has_changes(changes) -> bool:
    """Whether a drain (None while the engine's step runs on) holds anything to write."""
    return changes is not None and bool(changes.full or changes.stored or changes.removed)


def _apply(pipeline, key: str, changes) -> None:
    if changes.full:
        pipeline.delete(key)
    if changes.stored:
        pipeline.sadd(key, *changes.stored)
    if changes.removed:  # a full snapshot has none
        pipeline.srem(key, *changes.removed)


class KvIndexReader:
    """The gateway's reads of the index; one Redis round trip per routed request."""

    def __init__(self, redis_url: str, retry_s: float = 1.0, timeout_s: float = 0.2):
        self._client = redis_client(redis_url, timeout_s=timeout_s)
        self._failures = FailureStreak("KV index lookup")
        self.retry_s = retry_s
        self._retry_at = 0.0

    async def close(self) -> None:
        await self._client.aclose()

    async def cached_prefix_blocks(self, nodes: list[NodeInfo], block_hashes: list[bytes]) -> dict[str, int]:
        """node_id -> how many of the prompt's leading blocks it holds; {} if Redis is unreachable."""
        if not nodes or not block_hashes or time.monotonic() < self._retry_at:
            return {}
        pipeline = self._client.pipeline(transaction=False)
        for node in nodes:
            pipeline.smismember(kv_index_key(node.node_id, node.incarnation), block_hashes)
        try:
            memberships = await pipeline.execute()
        except (RedisError, OSError) as error:
            self._failures.failed(error)
            self._retry_at = time.monotonic() + self.retry_s
            return {}
        self._failures.succeeded()
        return {node.node_id: _leading_run(held) for node, held in zip(nodes, memberships)}


def _leading_run(held: list) -> int:
    """Blocks are chained: a block is usable only if every block before it is held too."""
    count = 0
    for is_member in held:
        if not is_member:
            break
        count += 1
    return count
