"""Routing policies on a fixed registry snapshot and a fake KV index."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import REGISTRY

from gateway.router import Router, RoutingPolicy
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo
from pdserve.engine.block_hash import hash_token_blocks
from pdserve.engine.scheduler import EngineLoad

BLOCK = 16


def node(node_id: str, role: str = "prefill", **load) -> NodeInfo:
    capacity = NodeCapacity(num_blocks=512, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=512)
    return NodeInfo(
        node_id=node_id, role=role, address=f"{node_id}:1", model="m", capacity=capacity, load=EngineLoad(**load)
    )


class FixedRegistry:
    def __init__(self, nodes):
        self._nodes = nodes

    def nodes(self, role=None):
        return sorted((n for n in self._nodes if role is None or n.role == role), key=lambda n: n.node_id)


class FakeIndex:
    """node_id -> the block hashes it holds; answers like KvIndexReader (leading run)."""

    def __init__(self, held: dict[str, list[bytes]] | None = None, down: bool = False):
        self.held = held or {}
        self.down = down
        self.num_lookups = 0

    async def cached_prefix_blocks(self, nodes, hashes):
        self.num_lookups += 1
        if self.down:
            return {}
        result = {}
        for n in nodes:
            count = 0
            while count < len(hashes) and hashes[count] in self.held.get(n.node_id, []):
                count += 1
            result[n.node_id] = count
        return result


PROMPT = list(range(1000))
HASHES = hash_token_blocks(PROMPT, BLOCK, extra_key="m")
CLUSTER = [node("p0"), node("p1"), node("d0", "decode"), node("d1", "decode")]


def route(router, prompt=PROMPT, exclude=frozenset()):
    return asyncio.run(router.route(prompt, exclude))


def test_prefix_aware_sends_a_prompt_where_its_prefix_is_cached():
    index = FakeIndex({"p1": HASHES[:50], "d1": HASHES[:10]})
    chosen = route(Router(FixedRegistry(CLUSTER), RoutingPolicy.PREFIX_AWARE, index))
    assert (chosen.prefill.node_id, chosen.decode.node_id) == ("p1", "d1")
    assert (chosen.predicted_prefill_cached_blocks, chosen.predicted_decode_cached_blocks) == (50, 10)
    assert index.num_lookups == 1  # every candidate in one lookup


def test_prefix_aware_weighs_cached_tokens_against_queued_work():
    busy = [node("p0"), node("p1", num_waiting_tokens=5000), node("d0", "decode")]
    index = FakeIndex({"p1": HASHES[:60]})  # 960 cached tokens do not beat 5000 queued ones
    assert route(Router(FixedRegistry(busy), RoutingPolicy.PREFIX_AWARE, index)).prefill.node_id == "p0"


def small_step_cluster(max_num_batched_tokens: int = 64) -> list[NodeInfo]:
    capacity = NodeCapacity(
        num_blocks=512, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens
    )
    prefills = [
        NodeInfo(node_id=i, role="prefill", address=f"{i}:1", model="m", capacity=capacity) for i in ("p0", "p1")
    ]
    return prefills + [node("d0", "decode"), node("d1", "decode")]


def test_bounded_load_cap_spreads_a_burst_on_one_prefix():
    index = FakeIndex({"p0": HASHES[:62]})  # 8 uncached tokens on p0, 1000 on p1
    router = Router(FixedRegistry(small_step_cluster(64)), RoutingPolicy.PREFIX_AWARE, index, load_factor=1.5)
    picks = []
    for _ in range(40):  # a burst: no prefill returns
        queued = dict(router.in_flight_tokens)
        chosen = route(router)
        router.acquire(chosen, len(PROMPT))
        picks.append(chosen.prefill.node_id)
        if chosen.prefill.node_id == "p0":  # p0 took it only while not over the cap
            assert queued.get("p0", 0) <= max(64, 1.5 * sum(queued.values()) / 2)
    assert picks[:9] == ["p0"] * 9  # the cached node, until its queue passes one step (64 tokens)
    assert picks[9] == "p1"  # then the cap, although p1 has to compute the whole prompt
    assert picks.count("p0") > picks.count("p1")  # p1's queue of 1000 tokens lets p0 take more


def test_a_queue_within_one_batched_step_is_not_capped():
    # Cache hits that fit in the node's next step together wait for nothing: they stay put.
    index = FakeIndex({"p0": HASHES[:62]})
    router = Router(FixedRegistry(small_step_cluster(512)), RoutingPolicy.PREFIX_AWARE, index, load_factor=1.25)
    for _ in range(20):  # 20 x 8 uncached tokens
        chosen = route(router)
        router.acquire(chosen, len(PROMPT))
        assert chosen.prefill.node_id == "p0"


def test_decode_cap_counts_requests_in_flight():
    index = FakeIndex({"d0": HASHES[:62]})
    router = Router(FixedRegistry(CLUSTER), RoutingPolicy.PREFIX_AWARE, index, load_factor=1.5)
    picks = []
    for sent in range(1, 13):
        chosen = route(router)
        router.acquire(chosen, len(PROMPT)).prefill_done()
        picks.append(chosen.decode.node_id)
        assert picks.count("d0") <= math.ceil(1.5 * sent / 2)
    assert picks[0] == "d0" and "d1" in picks


def test_prefix_aware_without_the_index_routes_by_load():
    index = FakeIndex(down=True)
    cluster = [
        node("p0", num_waiting_tokens=300),
        node("p1"),
        node("d0", "decode", num_running=5),
        node("d1", "decode"),
    ]
    chosen = route(Router(FixedRegistry(cluster), RoutingPolicy.PREFIX_AWARE, index))
    assert (chosen.prefill.node_id, chosen.decode.node_id) == ("p1", "d1")


def test_round_robin_takes_turns_and_ignores_the_index():
    index = FakeIndex({"p1": HASHES})
    router = Router(FixedRegistry(CLUSTER), RoutingPolicy.ROUND_ROBIN, index)
    assert [route(router).prefill.node_id for _ in range(4)] == ["p0", "p1", "p0", "p1"]
    assert index.num_lookups == 0


def test_least_load_counts_requests_in_flight_from_this_gateway():
    router = Router(FixedRegistry(CLUSTER), RoutingPolicy.LEAST_LOAD)
    first = route(router)
    lease = router.acquire(first, len(PROMPT))
    second = route(router)
    assert first.prefill.node_id != second.prefill.node_id and first.decode.node_id != second.decode.node_id
    lease.prefill_done()
    lease.release()
    lease.release()  # a second release changes nothing
    assert not router.in_flight and not router.in_flight_tokens


def test_a_prefill_node_is_free_once_its_prefill_returns():
    # Requests decoding elsewhere do not count against the prefill node that cached their prefix.
    index = FakeIndex({"p0": HASHES[:62]})
    router = Router(FixedRegistry(small_step_cluster(8)), RoutingPolicy.PREFIX_AWARE, index, load_factor=1.25)
    leases = []
    for _ in range(10):
        chosen = route(router)
        assert chosen.prefill.node_id == "p0"
        leases.append(router.acquire(chosen, len(PROMPT)))
        leases[-1].prefill_done()
    assert "p0" not in router.in_flight and "p0" not in router.in_flight_tokens
    assert sum(router.in_flight.values()) == 10  # all on decode nodes
    assert REGISTRY.get_sample_value("pdserve_gateway_in_flight_requests", {"node_id": "p0"}) == 0
    assert (
        sum(REGISTRY.get_sample_value("pdserve_gateway_in_flight_requests", {"node_id": d}) or 0 for d in ("d0", "d1"))
        == 10
    )
    for lease in leases:
        lease.release()
    assert not router.in_flight and not router.in_flight_tokens


def test_an_attempt_failing_before_its_prefill_frees_both_nodes():
    router = Router(FixedRegistry(CLUSTER), RoutingPolicy.PREFIX_AWARE, FakeIndex())
    router.acquire(route(router), len(PROMPT)).release()
    assert not router.in_flight and not router.in_flight_tokens


def test_colocated_nodes_and_exclusions():
    cluster = [node("c0", "colocated"), node("c1", "colocated")]
    router = Router(FixedRegistry(cluster), RoutingPolicy.PREFIX_AWARE, FakeIndex({"c1": HASHES[:5]}))
    chosen = route(router)
    assert chosen.prefill is None and chosen.decode.node_id == "c1"
    assert route(router, exclude={"c1"}).decode.node_id == "c0"
    assert route(router, exclude={"c0", "c1"}) is None


def test_load_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="load_factor"):
        Router(FixedRegistry(CLUSTER), load_factor=0.5)
