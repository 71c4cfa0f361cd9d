"""Picks the nodes for a request: a prefill node and a decode node, or one colocated node.

Policies (`--router-policy`):
    round_robin   each role's nodes in turn
    least_load    prefill: fewest queued prompt tokens; decode: fewest running sequences
    prefix_aware  (default) uses the cluster's KV index (pdserve/cluster_state/kv_index.py):
                  prefill: least work, i.e. the prompt tokens it would have to compute (those
                           after its longest cached prefix) plus the tokens already queued on it;
                  decode:  most of the prompt's leading blocks held (they need no transfer),
                           then least loaded;
                  both under a bounded-load cap, so a popular prefix spreads instead of
                  piling onto one node: a prefill node whose queued prompt tokens exceed both
                  one batched step (its max_num_batched_tokens: prompts that fit in the next
                  step wait for no other) and `load_factor` x the mean queue takes no new
                  prompt; a decode node takes a request only while its in-flight count stays
                  within `load_factor` x the mean.
Without the index (Redis away) prefix_aware sees no cached blocks and routes by load alone.

Heartbeats refresh the registry's load once a second; between beats a burst of requests
would all see the same numbers and pile onto one node, so the router adds the requests it
has itself sent to each node and not yet seen finish there (`in_flight`, `in_flight_tokens`).
A prefill node is done with a request when its prefill returns (the decode node then runs
it), so a prefill node's in-flight count is its queue of prompts, not of whole requests:
counting the decode phase too would make the cap push prompts off their cached node while
the node has nothing to compute.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

from prometheus_client import Counter as MetricCounter
from prometheus_client import Gauge

from gateway.settings import RoutingPolicy
from pdserve.cluster_state.kv_index import KvIndexReader
from pdserve.cluster_state.registry import NodeInfo, RegistryView
from pdserve.engine.block_hash import hash_token_blocks

ROUTING_DECISIONS = MetricCounter(
    "pdserve_gateway_routing_decisions",
    "Nodes picked, by policy, role and why",
    ["policy", "role", "node_id", "reason"],
)
IN_FLIGHT = Gauge(
    "pdserve_gateway_in_flight_requests",
    "Requests this gateway has sent to a node that it has not finished",
    ["node_id"],
)
QUEUED_TOKENS = Gauge(
    "pdserve_gateway_queued_prompt_tokens",
    "Uncached prompt tokens this gateway has sent to a prefill node, prefill not returned",
    ["node_id"],
)


@dataclass(frozen=True)
class Route:
    """The nodes one attempt uses; `prefill` is None for a colocated node. The predicted
    cached-block counts come from the KV index (0 when unknown)."""

    prefill: NodeInfo | None
    decode: NodeInfo
    predicted_prefill_cached_blocks: int = 0
    predicted_decode_cached_blocks: int = 0

    @property
    def nodes(self) -> list[NodeInfo]:
        return [n for n in (self.prefill, self.decode) if n is not None]


class Router:
    """Mutates only its in-flight counters and round-robin positions."""

    def __init__(
        self,
        registry: RegistryView,
        policy: RoutingPolicy = RoutingPolicy.PREFIX_AWARE,
        kv_index: KvIndexReader | None = None,
        load_factor: float = 1.25,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.registry = registry
        self.policy = RoutingPolicy(policy)
        self.kv_index = kv_index
        self.load_factor = load_factor
        self.in_flight: Counter[str] = Counter()
        self.in_flight_tokens: Counter[str] = Counter()  # prompt tokens sent to a prefill node, not yet done
        self._turns: dict[str, itertools.count] = {}

    def candidates(self, role: str, exclude: set[str] = frozenset()) -> list[NodeInfo]:
        return [n for n in self.registry.nodes(role) if n.node_id not in exclude]

    async def route(self, prompt_token_ids: list[int], exclude: set[str] = frozenset()) -> Route | None:
        """The nodes for one attempt, or None if no usable set is registered."""
        colocated = self.candidates("colocated", exclude)
        prefills, decodes = self.candidates("prefill", exclude), self.candidates("decode", exclude)
        if colocated:
            prefills, decodes = [], colocated
        elif not (prefills and decodes):
            return None
        cached = await self._cached_blocks(prefills + decodes, prompt_token_ids)
        decode, decode_reason = self._pick_decode(decodes, cached)
        if not prefills:
            self._count("colocated", decode, decode_reason)
            return Route(None, decode, 0, cached.get(decode.node_id, 0))
        prefill, prefill_reason = self._pick_prefill(prefills, cached, len(prompt_token_ids))
        self._count("prefill", prefill, prefill_reason)
        self._count("decode", decode, decode_reason)
        return Route(prefill, decode, cached.get(prefill.node_id, 0), cached.get(decode.node_id, 0))

    def acquire(self, route: Route, num_prompt_tokens: int) -> RouteLease:
        """Counts the attempt against its nodes until the lease says they are done with it."""
        uncached = 0
        if route.prefill is not None:
            uncached = _uncached_tokens(route.prefill, route.predicted_prefill_cached_blocks, num_prompt_tokens)
            self._add(route.prefill.node_id, 1, uncached)
        self._add(route.decode.node_id, 1)
        return RouteLease(self, route, uncached)

    def _add(self, node_id: str, requests: int, prompt_tokens: int = 0) -> None:
        _adjust(self.in_flight, IN_FLIGHT, node_id, requests)
        if prompt_tokens:  # decode nodes queue no prompt tokens: no gauge series for them
            _adjust(self.in_flight_tokens, QUEUED_TOKENS, node_id, prompt_tokens)

    async def _cached_blocks(self, nodes: list[NodeInfo], prompt_token_ids: list[int]) -> dict[str, int]:
        """node_id -> leading prompt blocks cached there, for every candidate in one Redis round trip."""
        if self.policy != RoutingPolicy.PREFIX_AWARE or self.kv_index is None:
            return {}
        cached: dict[str, int] = {}
        for (block_size, model), group in _group_by_cache_layout(nodes).items():
            hashes = hash_token_blocks(prompt_token_ids, block_size, extra_key=model)
            cached |= await self.kv_index.cached_prefix_blocks(group, hashes)
        return cached

    def _pick_prefill(self, nodes: list[NodeInfo], cached: dict[str, int], num_tokens: int) -> tuple[NodeInfo, str]:
        if self.policy == RoutingPolicy.ROUND_ROBIN:
            return self._next_in_turn("prefill", nodes), "turn"
        if self.policy == RoutingPolicy.LEAST_LOAD:
            return min(nodes, key=lambda n: (self._queued_tokens(n), n.node_id)), "load"

        def work(node: NodeInfo) -> int:
            return _uncached_tokens(node, cached.get(node.node_id, 0), num_tokens) + self._queued_tokens(node)

        # Load is queued prompt tokens, the unit of the cost; the least-queued node is always within.
        cap = self.load_factor * sum(self._queued_tokens(n) for n in nodes) / len(nodes)
        within = [n for n in nodes if self._queued_tokens(n) <= max(cap, n.capacity.max_num_batched_tokens)]
        return self._cheapest(nodes, within, lambda n: (work(n), n.node_id), cached)

    def _pick_decode(self, nodes: list[NodeInfo], cached: dict[str, int]) -> tuple[NodeInfo, str]:
        role = nodes[0].role
        if self.policy == RoutingPolicy.ROUND_ROBIN:
            return self._next_in_turn(role, nodes), "turn"
        if self.policy == RoutingPolicy.LEAST_LOAD:
            return min(nodes, key=lambda n: (*self._decode_load(n), n.node_id)), "load"
        # Load is requests in flight, counting this one; the ceiling keeps the least loaded within.
        cap = math.ceil(self.load_factor * (sum(self.in_flight[n.node_id] for n in nodes) + 1) / len(nodes))
        within = [n for n in nodes if self.in_flight[n.node_id] + 1 <= cap]
        return self._cheapest(
            nodes, within, lambda n: (-cached.get(n.node_id, 0), *self._decode_load(n), n.node_id), cached
        )

    @staticmethod
    def _cheapest(
        nodes: list[NodeInfo], within_cap: list[NodeInfo], cost, cached: dict[str, int]
    ) -> tuple[NodeInfo, str]:
        """The cheapest node within the bounded-load cap, and why it won."""
        best = min(within_cap, key=cost)
        unbounded_best = min(nodes, key=cost)
        if best is not unbounded_best:
            return best, "load_cap"
        return best, "prefix" if cached.get(best.node_id, 0) > 0 else "load"

    def _queued_tokens(self, node: NodeInfo) -> int:
        # The node's own report is up to a heartbeat old; this gateway's count is current.
        return max(node.load.num_waiting_tokens, self.in_flight_tokens[node.node_id])

    def _decode_load(self, node: NodeInfo) -> tuple[int, int]:
        return node.load.num_running + self.in_flight[node.node_id], -node.load.num_free_blocks

    def _next_in_turn(self, role: str, nodes: list[NodeInfo]) -> NodeInfo:
        turn = next(self._turns.setdefault(role, itertools.count()))
        return nodes[turn % len(nodes)]

    def _count(self, role: str, node: NodeInfo, reason: str) -> None:
        ROUTING_DECISIONS.labels(self.policy.value, role, node.node_id, reason).inc()


class RouteLease:
    """One attempt's place in the router's in-flight counts. `prefill_done` frees the prefill
    node; `release` frees the rest (and the prefill node, if the attempt failed before its
    prefill returned). Both may be called more than once."""

    def __init__(self, router: Router, route: Route, uncached_tokens: int) -> None:
        self._router, self._route, self._uncached_tokens = router, route, uncached_tokens
        self._prefill_held, self._decode_held = route.prefill is not None, True

    def prefill_done(self) -> None:
        if self._prefill_held:
            self._prefill_held = False
            self._router._add(self._route.prefill.node_id, -1, -self._uncached_tokens)

    def release(self) -> None:
        self.prefill_done()
        if self._decode_held:
            self._decode_held = False
            self._router._add(self._route.decode.node_id, -1)


def _adjust(counter: Counter[str], gauge: Gauge, node_id: str, amount: int) -> None:
    """Adds to a node's count, mirrored in its gauge; a count back at zero leaves the counter."""
    counter[node_id] += amount
    gauge.labels(node_id).set(max(counter[node_id], 0))
    if counter[node_id] <= 0:
        del counter[node_id]


def _uncached_tokens(node: NodeInfo, cached_blocks: int, num_prompt_tokens: int) -> int:
    """Prompt tokens the node would compute: at least one, whose logits give the first token."""
    usable_blocks = min(cached_blocks, (num_prompt_tokens - 1) // node.capacity.block_size)
    return num_prompt_tokens - usable_blocks * node.capacity.block_size


def _group_by_cache_layout(nodes: list[NodeInfo]) -> dict[tuple[int, str], list[NodeInfo]]:
    """Nodes whose block hashes are comparable: same block size and model (the hash's extra key)."""
    groups: dict[tuple[int, str], list[NodeInfo]] = {}
    for node in nodes:
        groups.setdefault((node.capacity.block_size, node.model), []).append(node)
    return groups
