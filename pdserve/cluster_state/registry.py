"""The node registry: which nodes exist and how loaded they are, kept in Redis with heartbeats.

Each node owns one key, `pdserve:node:{node_id}`, holding its `NodeInfo` as JSON with a TTL.

Node side (`NodeRegistration`):
    1. start(): write the key once, then every `interval_s` rewrite it with fresh load and
       stats and `EX ttl`
    2. a node that dies stops beating; its key expires `ttl_s` later and it leaves every view
    3. stop(): delete the key, but only if it still holds this incarnation (a restarted node with
       the same node_id may already have replaced it)

Gateway side (`RegistryView`):
    1. start(): read all node keys, then every `refresh_s` SCAN + MGET them into a new snapshot
    2. nodes() returns the last snapshot without touching Redis, so routing never waits on it
    3. while Redis is unreachable the last snapshot is kept, minus the nodes that stop answering
       the view's `probe` (the gateway's direct gRPC health check): heartbeats cannot reach us,
       so their age says nothing about a node
    4. for `ttl_s` after Redis is back, a node of the last snapshot that has not re-registered
       yet (Redis restarted empty, or its key expired while Redis was stopped) is kept while it
       answers the probe; then Redis alone decides again
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import typing
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from redis import RedisError
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.cluster_state.secret import sign_entry, verify_entry
from pdserve.engine.scheduler import EngineLoad

logger = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:node:"
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TTL_S = 3.0

NodeRole = Literal["prefill", "decode", "colocated"]
NODE_ROLES: tuple[NodeRole, ...] = typing.get_args(NodeRole)

# Atomic compare-and-delete: a stopping node must not remove the entry of its own replacement.
_DELETE_IF_INCARNATION = """
local value = redis.call('GET', KEYS[1])
if value and cjson.decode(value)['incarnation'] == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class NodeStats(BaseModel):
    """Counters since the node started: its prefix-cache hit rate and the KV it received."""

    model_config = ConfigDict(frozen=True)

    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, found cached
    kv_blocks_received: int = 0  # decode: blocks filled by pushed pages (gRPC or shared memory)
    kv_bytes_received: int = 0  # decode: page bytes that came over gRPC


class NodeCapacity(BaseModel):
    model_config = ConfigDict(frozen=True)

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


class NodeInfo(BaseModel):
    """One node as the registry stores it; unknown JSON fields are ignored (newer nodes, older gateway)."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    role: NodeRole
    address: str  # "host:port" of the node's gRPC server
    metrics_address: str = ""  # "host:port" of its Prometheus /metrics ("": none)
    # "host:port" of a decode node's token stream (protos/token_stream.py; "": read Generate over gRPC)
    token_stream_address: str = ""
    model: str
    capacity: NodeCapacity
    load: EngineLoad = EngineLoad()  # the engine's own record, as its heartbeat last carried it
    stats: NodeStats = NodeStats()
    # Stopping (SIGTERM): it finishes what it has and takes no new request; routers skip it, but
    # prefill nodes still push to it the pages of requests it has already reserved for.
    draining: bool = False
    incarnation: str = Field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)

    @property
    def key(self) -> str:
        return node_key(self.node_id)

    def to_json(self, secret: str | None = None) -> str:
        """The entry as stored; signed with the cluster secret when there is one (secret.py)."""
        if secret is None:
            return self.model_dump_json()
        return json.dumps(sign_entry(self.model_dump(mode="json"), secret), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> NodeInfo:
        return cls.model_validate_json(data)


class RedisOptions(BaseModel):
    """Where the cluster's Redis is: an option of every process that reads or writes the registry."""

    model_config = ConfigDict(frozen=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="the cluster's Redis")


def node_key(node_id: str) -> str:
    return KEY_PREFIX + node_id


def redis_client(redis_url: str, timeout_s: float = 1.0) -> Redis:
    """An asyncio client that fails fast: callers here retry on their own schedule.

    One immediate retry on a broken connection only: after Redis restarts, a pooled connection
    fails once before it reconnects, and that should not cost a heartbeat. A timeout (Redis
    stopped) is not retried. Every write here is idempotent, so a retried one is harmless."""
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    return Redis.from_url(redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=retry)


class FailureStreak:
    """Logs the first failure of a streak and the recovery, not every failed attempt."""

    def __init__(self, what: str):
        self.what = what
        self.failing = False

    def failed(self, error: BaseException) -> None:
        if not self.failing:
            logger.warning(
                "%s failed (%s: %s); retrying quietly until it recovers", self.what, type(error).__name__, error
            )
        self.failing = True

    def succeeded(self) -> None:
        if self.failing:
            logger.info("%s recovered", self.what)
        self.failing = False


class Periodic:
    """Runs `step` every `interval_s` in a task until stop().

    stop() sets an event instead of cancelling: redis-py can turn a cancel that lands mid-command
    into a ConnectionError, which the step swallows, and the task would then never end.
    """

    def __init__(self, step: Callable[[], Awaitable[object]], interval_s: float, name: str):
        self._step = step
        self.interval_s = interval_s
        self.name = name
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None

    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while not await self._stopped_within(self.interval_s):
            try:
                await self._step()
            except Exception:
                logger.exception("%s step raised", self.name)

    async def _stopped_within(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class NodeRegistration:
    """Keeps this node's key alive in Redis. Never raises on Redis errors: the node keeps serving."""

    def __init__(
        self,
        redis_url: str,
        node_info: NodeInfo,
        load_fn: Callable[[], EngineLoad],
        interval_s: float = DEFAULT_INTERVAL_S,
        ttl_s: float = DEFAULT_TTL_S,
        stats_fn: Callable[[], NodeStats] = NodeStats,
        secret: str | None = None,
    ):
        if ttl_s <= interval_s:
            raise ValueError(f"ttl_s ({ttl_s}) must exceed interval_s ({interval_s}), e.g. ttl_s = 3 * interval_s")
        self.node_info = node_info
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._load_fn = load_fn
        self._stats_fn = stats_fn
        self._secret = secret  # signs each entry: a gateway with the secret ignores unsigned ones
        self._client = redis_client(redis_url)
        self._failures = FailureStreak(f"heartbeat of node {node_info.node_id}")
        self._heartbeat = Periodic(self.beat, interval_s, f"heartbeat-{node_info.node_id}")

    async def start(self) -> None:
        # Beat once before returning so the node is visible as soon as start() is done.
        await self.beat()
        self._heartbeat.start()
        logger.info(
            "node %s (%s) at %s heartbeats every %.1f s",
            self.node_info.node_id,
            self.node_info.role,
            self.node_info.address,
            self.interval_s,
        )

    async def drain(self) -> None:
        """Marks the entry draining at once (routers stop sending new requests within a refresh);
        heartbeats go on until stop()."""
        self.node_info = self.node_info.model_copy(update={"draining": True})
        await self.beat()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        try:
            await self._client.eval(_DELETE_IF_INCARNATION, 1, self.node_info.key, self.node_info.incarnation)
        except (RedisError, OSError) as error:
            logger.warning(
                "could not deregister %s (%s); its key expires within %.1f s", self.node_info.node_id, error, self.ttl_s
            )
        finally:
            await self._client.aclose()

    async def beat(self) -> bool:
        """Write the key once with fresh load; returns whether it was written."""
        try:
            info = self.node_info.model_copy(
                update={"load": self._load_fn(), "stats": self._stats_fn(), "updated_at": time.time()}
            )
            await self._client.set(info.key, info.to_json(self._secret), px=int(self.ttl_s * 1000))
        except Exception as error:
            self._failures.failed(error)
            return False
        self.node_info = info
        self._failures.succeeded()
        return True


# The node_ids of `nodes` that answered a direct health check just now.
NodeProbe = Callable[[list[NodeInfo]], Awaitable[set[str]]]


class RegistryView:
    """The gateway's in-memory copy of the registry, refreshed in the background.

    `probe` checks nodes directly while Redis cannot vouch for them (see the module docstring);
    without one, the last snapshot is kept whole through an outage. With a `secret`, entries
    whose signature does not verify are ignored: whoever can write to Redis cannot add a node."""

    def __init__(
        self,
        redis_url: str,
        refresh_s: float = 0.5,
        ttl_s: float = DEFAULT_TTL_S,
        probe: NodeProbe | None = None,
        secret: str | None = None,
    ):
        self.refresh_s = refresh_s
        self.ttl_s = ttl_s
        self._client = redis_client(redis_url)
        self._probe = probe
        self._secret = secret
        self._failures = FailureStreak("registry refresh")
        self._node_id_to_info: dict[str, NodeInfo] = {}
        self._bad_keys: set[bytes] = set()
        self._last_failure_at = -math.inf  # monotonic time of the last failed read
        self._refresher = Periodic(self.refresh, refresh_s, "registry-view")

    async def start(self) -> None:
        await self.refresh()
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()
        await self._client.aclose()

    def nodes(self, role: NodeRole | None = None, include_draining: bool = False) -> list[NodeInfo]:
        """The last snapshot, sorted by node_id, without draining nodes unless asked; never waits on Redis."""
        infos = sorted(self._node_id_to_info.values(), key=lambda info: info.node_id)
        return [
            info for info in infos if (role is None or info.role == role) and (include_draining or not info.draining)
        ]

    def get(self, node_id: str) -> NodeInfo | None:
        return self._node_id_to_info.get(node_id)

    async def refresh(self) -> bool:
        """Replace the snapshot from Redis; returns False (and keeps the nodes that still answer) if Redis failed."""
        try:
            snapshot = await self._read_all()
        except (RedisError, OSError) as error:
            self._failures.failed(error)
            self._last_failure_at = time.monotonic()
            self._node_id_to_info = await self._answering(self._node_id_to_info)
            return False
        self._failures.succeeded()
        self._node_id_to_info = snapshot | await self._not_yet_reregistered(snapshot)
        return True

    async def _not_yet_reregistered(self, snapshot: dict[str, NodeInfo]) -> dict[str, NodeInfo]:
        # Right after an outage a live node may not have beaten yet: dropping it would leave a
        # role with no node (503) for up to a heartbeat. `ttl_s` covers a heartbeat or more.
        if time.monotonic() - self._last_failure_at > self.ttl_s:
            return {}
        missing = {node_id: info for node_id, info in self._node_id_to_info.items() if node_id not in snapshot}
        return await self._answering(missing)

    async def _answering(self, node_id_to_info: dict[str, NodeInfo]) -> dict[str, NodeInfo]:
        """The nodes that answer the probe (all of them without one)."""
        if self._probe is None or not node_id_to_info:
            return dict(node_id_to_info)
        answered = await self._probe(list(node_id_to_info.values()))
        return {node_id: info for node_id, info in node_id_to_info.items() if node_id in answered}

    async def _read_all(self) -> dict[str, NodeInfo]:
        keys = [key async for key in self._client.scan_iter(match=KEY_PREFIX + "*", count=1000)]
        values = await self._client.mget(keys) if keys else []
        snapshot = {}
        for key, value in zip(keys, values):
            info = self._parse(key, value)
            if info is not None:
                snapshot[info.node_id] = info
        return snapshot

    def _parse(self, key: bytes, value: bytes | None) -> NodeInfo | None:
        if value is None:  # expired between SCAN and MGET
            return None
        try:
            entry = json.loads(value)
            if self._secret is not None and not verify_entry(entry, self._secret):
                self._ignore(key, "its signature does not verify with the cluster secret")
                return None
            return NodeInfo.model_validate(entry)
        except (ValueError, pydantic.ValidationError) as error:  # JSONDecodeError is a ValueError
            self._ignore(key, f"it is malformed: {error}")
            return None

    def _ignore(self, key: bytes, reason: str) -> None:
        if key not in self._bad_keys:  # warn once per key, not once per refresh
            logger.warning("ignoring registry entry %s: %s", key.decode(errors="replace"), reason)
            self._bad_keys.add(key)
