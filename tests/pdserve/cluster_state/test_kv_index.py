"""The KV location index against a real Redis: what nodes publish and what the gateway reads."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from pdserve.cluster_state.embedded_redis import EmbeddedRedis
from pdserve.cluster_state.kv_index import KvIndexPublisher, KvIndexReader, kv_index_key
from pdserve.engine.block_hash import hash_token_blocks
from pdserve.engine.llm_engine import KvCacheChanges
from tests.pdserve.cluster_state.test_registry import make_node

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


class FakeEngineCache:
    """Plays the engine's `kv_cache_changes(full)`: a set of cached hashes plus a change log."""

    def __init__(self, cached=()):
        self.cached = set(cached)
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []
        self.num_full = 0

    def store(self, *hashes):
        self.cached.update(hashes)
        self.stored += hashes

    def evict(self, *hashes):
        self.cached.difference_update(hashes)
        self.removed += hashes

    async def changes(self, full: bool) -> KvCacheChanges:
        if full:
            self.num_full += 1
            self.stored, self.removed = [], []
            return KvCacheChanges(sorted(self.cached), [], True)
        changes = KvCacheChanges(self.stored, self.removed, False)
        self.stored, self.removed = [], []
        return changes


def members(url: str, node) -> set[bytes]:
    return redis.Redis.from_url(url).smembers(kv_index_key(node.node_id, node.incarnation))


def test_publisher_mirrors_the_prefix_cache_and_reader_counts_leading_blocks(redis_url):
    node, other = make_node("prefill-0"), make_node("prefill-1", port=50052)
    hashes = hash_token_blocks(list(range(64)), 16, "tiny")  # 4 chained blocks

    async def body():
        cache = FakeEngineCache(hashes[:2])
        publisher = KvIndexPublisher(redis_url, node, cache.changes, ttl_s=2.0, interval_s=0.05)
        reader = KvIndexReader(redis_url)
        await publisher.start()
        try:
            assert members(redis_url, node) == set(hashes[:2])
            assert await reader.cached_prefix_blocks([node, other], hashes) == {"prefill-0": 2, "prefill-1": 0}
            cache.store(hashes[3])  # not usable: block 2 is missing in between
            await publisher.flush()
            assert await reader.cached_prefix_blocks([node], hashes) == {"prefill-0": 2}
            cache.store(hashes[2])
            cache.evict(hashes[0])
            await publisher.flush()
            assert members(redis_url, node) == set(hashes[1:])
            assert await reader.cached_prefix_blocks([node], hashes) == {"prefill-0": 0}  # the chain starts at block 0
        finally:
            await publisher.stop()
            await reader.close()
        assert members(redis_url, node) == set()  # stop() deletes the set

    asyncio.run(body())


def test_sets_expire_without_flushes_and_a_new_incarnation_starts_empty(redis_url):
    node = make_node("prefill-0")
    restarted = make_node("prefill-0")  # same node id, new incarnation
    hashes = hash_token_blocks(list(range(32)), 16, "tiny")

    async def body():
        cache = FakeEngineCache(hashes)
        publisher = KvIndexPublisher(redis_url, node, cache.changes, ttl_s=0.5, interval_s=0.05)
        await publisher.flush()  # once, then the "node" dies
        reader = KvIndexReader(redis_url)
        assert await reader.cached_prefix_blocks([node], hashes) == {"prefill-0": 2}
        assert await reader.cached_prefix_blocks([restarted], hashes) == {"prefill-0": 0}
        start = time.monotonic()
        while members(redis_url, node):
            assert time.monotonic() - start < 2.0, "the dead incarnation's entries outlived the TTL"
            await asyncio.sleep(0.05)
        await reader.close()

    asyncio.run(body())


def test_the_index_is_rebuilt_after_redis_loses_it(redis_url):
    node = make_node("decode-0", role="decode")
    hashes = hash_token_blocks(list(range(48)), 16, "tiny")

    async def body():
        cache = FakeEngineCache(hashes[:1])
        publisher = KvIndexPublisher(redis_url, node, cache.changes, ttl_s=2.0, interval_s=0.05)
        await publisher.flush()
        redis.Redis.from_url(redis_url).flushall()  # Redis restarted empty
        cache.store(hashes[1])
        await publisher.flush()  # applies the change, notices the set was gone
        await publisher.flush()  # full snapshot
        assert members(redis_url, node) == set(hashes[:2])
        assert cache.num_full == 2

    asyncio.run(body())


def test_reader_answers_empty_at_once_while_redis_is_down():
    async def body():
        reader = KvIndexReader("redis://127.0.0.1:1/0", retry_s=5.0)
        start = time.monotonic()
        assert await reader.cached_prefix_blocks([make_node()], [b"x" * 16]) == {}
        assert await reader.cached_prefix_blocks([make_node()], [b"x" * 16]) == {}  # no retry yet
        assert time.monotonic() - start < 1.0
        await reader.close()

    asyncio.run(body())


def test_publisher_survives_redis_down_and_rebuilds_when_it_returns():
    node = make_node()
    hashes = hash_token_blocks(list(range(32)), 16, "tiny")

    async def body(server):
        cache = FakeEngineCache(hashes[:1])
        publisher = KvIndexPublisher(server.url, node, cache.changes, ttl_s=5.0, interval_s=0.05)
        await publisher.flush()
        os.kill(server.pid, signal.SIGSTOP)  # Redis stops answering
        try:
            cache.store(hashes[1])
            await publisher.flush()  # times out: whether the write landed is unknown
        finally:
            os.kill(server.pid, signal.SIGCONT)
        cache.evict(hashes[0])  # a change after the outage
        await publisher.flush()  # Redis is back: a full snapshot, not just new changes
        assert members(server.url, node) == {hashes[1]}
        assert cache.num_full == 2
        await publisher.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))


HASH_SCRIPT = (
    "from pdserve.engine.block_hash import hash_token_blocks; "
    "print(b''.join(hash_token_blocks(list(range(100)), 16, 'm')).hex())"
)


def test_block_hashes_are_identical_across_processes_with_different_hash_seeds():
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    assert outputs == {b"".join(hash_token_blocks(list(range(100)), 16, "m")).hex()}


def test_a_running_publisher_rebuilds_the_index_after_redis_restarts_empty():
    node = make_node("decode-0", role="decode")
    hashes = hash_token_blocks(list(range(48)), 16, "tiny")

    async def body(server: EmbeddedRedis):
        cache = FakeEngineCache(hashes)
        publisher = KvIndexPublisher(server.url, node, cache.changes, ttl_s=2.0, interval_s=0.05)
        await publisher.start()
        assert members(server.url, node) == set(hashes)
        os.kill(server.pid, signal.SIGKILL)
        while server.poll() is None:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # flushes fail meanwhile
        assert server.restart()  # empty, on the same port
        deadline = time.monotonic() + 3
        while members(server.url, node) != set(hashes):
            assert time.monotonic() < deadline, "the index was not rebuilt"
            await asyncio.sleep(0.05)
        await publisher.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))


def pexpire_calls(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return stats.get("cmdstat_pexpire", {}).get("calls", 0)


def test_an_idle_publisher_refreshes_the_ttl_in_time_without_a_round_trip_per_flush(redis_url):
    """Measured: with nothing to change, every 100 ms flush still sent a PEXPIRE (the node's RPC
    thread spent about a third of its CPU on it, beside the engine). It now refreshes the TTL a
    few times per TTL, and the set still outlives it."""
    node = make_node("decode-0", role="decode")
    hashes = hash_token_blocks(list(range(32)), 16, "tiny")

    async def body():
        cache = FakeEngineCache(hashes)
        publisher = KvIndexPublisher(redis_url, node, cache.changes, ttl_s=0.6, interval_s=0.02)
        await publisher.start()
        calls_before = pexpire_calls(redis_url)
        await asyncio.sleep(1.5)  # 2.5 TTLs, ~75 flushes
        assert members(redis_url, node) == set(hashes)  # kept alive
        assert pexpire_calls(redis_url) - calls_before <= 12  # a refresh every 0.2 s, not one per flush
        cache.store(b"x" * 16)  # a change still goes out on the next flush
        await asyncio.sleep(0.1)
        assert b"x" * 16 in members(redis_url, node)
        await publisher.stop()

    asyncio.run(body())
