from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

from pdserve.cluster_state.embedded_redis import EmbeddedRedis
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeRegistration, RegistryView, node_key
from pdserve.engine.scheduler import EngineLoad

pytestmark = pytest.mark.timeout(60)

FAST = {"interval_s": 0.1, "ttl_s": 1.0}


@pytest.fixture
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def make_node(node_id: str = "prefill-0", role: str = "prefill", port: int = 50051) -> NodeInfo:
    capacity = NodeCapacity(num_blocks=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    return NodeInfo(node_id=node_id, role=role, address=f"127.0.0.1:{port}", model="tiny", capacity=capacity)


async def wait_for(predicate, view: RegistryView, timeout_s: float = 3.0) -> float:
    """Refresh the view until predicate(view) holds; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        await view.refresh()
        if predicate(view):
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met before the timeout")


def test_node_info_json_round_trip_ignores_unknown_fields():
    info = make_node()
    assert NodeInfo.from_json(info.to_json()) == info
    assert len(info.incarnation) == 32 and info.incarnation != make_node().incarnation
    newer = info.to_json()[:-1] + ', "future_field": 1}'
    assert NodeInfo.from_json(newer) == info


def test_ttl_must_exceed_interval(redis_url):
    with pytest.raises(ValueError, match="must exceed"):
        NodeRegistration(redis_url, make_node(), EngineLoad, interval_s=1.0, ttl_s=1.0)


def test_registered_node_appears_with_its_load(redis_url):
    async def body():
        load = EngineLoad(num_waiting_tokens=7, num_running=2, num_free_blocks=100, num_pending_transfers=1)
        registration = NodeRegistration(redis_url, make_node(), lambda: load, **FAST)
        view = RegistryView(redis_url, ttl_s=1.0)
        await registration.start()
        await view.refresh()
        [seen] = view.nodes()
        assert (seen.node_id, seen.address, seen.load) == ("prefill-0", "127.0.0.1:50051", load)
        assert seen.incarnation == registration.node_info.incarnation
        with redis.Redis.from_url(redis_url) as client:
            assert 0 < client.pttl(node_key("prefill-0")) <= 1000
        await registration.stop()
        await view.stop()

    asyncio.run(body())


def test_load_updates_appear(redis_url):
    async def body():
        current = {"load": EngineLoad(num_running=1)}
        registration = NodeRegistration(redis_url, make_node(), lambda: current["load"], **FAST)
        view = RegistryView(redis_url, refresh_s=0.05, ttl_s=1.0)
        await registration.start()
        await view.start()
        current["load"] = EngineLoad(num_running=5, num_free_blocks=3)
        deadline = time.monotonic() + 3.0
        while view.get("prefill-0").load.num_running != 5:  # the background refresh picks it up
            assert time.monotonic() < deadline, "load update never reached the view"
            await asyncio.sleep(0.05)
        assert view.get("prefill-0").load == EngineLoad(num_running=5, num_free_blocks=3)
        await registration.stop()
        await view.stop()

    asyncio.run(body())


def test_nodes_filters_by_role_and_sorts_by_id(redis_url):
    async def body():
        registrations = [
            NodeRegistration(redis_url, make_node(node_id, role), EngineLoad, **FAST)
            for node_id, role in [("prefill-1", "prefill"), ("decode-0", "decode"), ("prefill-0", "prefill")]
        ]
        for registration in registrations:
            await registration.start()
        view = RegistryView(redis_url, ttl_s=1.0)
        await view.refresh()
        assert [n.node_id for n in view.nodes()] == ["decode-0", "prefill-0", "prefill-1"]
        assert [n.node_id for n in view.nodes("prefill")] == ["prefill-0", "prefill-1"]
        assert view.nodes("colocated") == []
        for registration in registrations:
            await registration.stop()
        await view.stop()

    asyncio.run(body())


def test_silent_node_disappears_after_ttl(redis_url):
    async def body():
        registration = NodeRegistration(redis_url, make_node(), EngineLoad, **FAST)
        view = RegistryView(redis_url, ttl_s=1.0)
        await registration.start()
        await registration._heartbeat.stop()  # the node "crashes": no more beats, no delete
        silent_since = time.monotonic()
        await view.refresh()
        assert [n.node_id for n in view.nodes()] == ["prefill-0"]
        await wait_for(lambda v: v.nodes() == [], view)
        assert time.monotonic() - silent_since > 0.8  # gone by expiry, not earlier
        await view.stop()

    asyncio.run(body())


def test_stop_removes_the_node_at_once(redis_url):
    async def body():
        registration = NodeRegistration(redis_url, make_node(), EngineLoad, **FAST)
        view = RegistryView(redis_url, ttl_s=1.0)
        await registration.start()
        await view.refresh()
        assert len(view.nodes()) == 1
        await registration.stop()
        await view.refresh()
        assert view.nodes() == []
        await view.stop()

    asyncio.run(body())


def test_a_draining_node_stays_registered_but_leaves_the_routable_nodes_at_once(redis_url):
    async def body():
        registration = NodeRegistration(redis_url, make_node("decode-0", "decode"), EngineLoad, **FAST)
        view = RegistryView(redis_url, ttl_s=1.0)
        await registration.start()
        await registration.drain()
        await view.refresh()
        assert view.nodes() == [] and view.nodes("decode") == []
        [draining] = view.nodes("decode", include_draining=True)
        assert draining.draining and draining.node_id == "decode-0"
        await asyncio.sleep(1.5)  # past the TTL: the heartbeats keep the draining entry alive
        await view.refresh()
        assert [n.node_id for n in view.nodes(include_draining=True)] == ["decode-0"]
        await registration.stop()
        await view.refresh()
        assert view.nodes(include_draining=True) == []
        await view.stop()

    asyncio.run(body())


def test_restarted_node_replaces_old_entry_and_old_stop_keeps_it(redis_url):
    async def body():
        old = NodeRegistration(redis_url, make_node(port=1111), EngineLoad, **FAST)
        new = NodeRegistration(redis_url, make_node(port=2222), EngineLoad, **FAST)
        view = RegistryView(redis_url, ttl_s=1.0)
        await old.start()
        await old._heartbeat.stop()  # the old process died...
        await new.start()  # ...and came back with a new incarnation under the same node_id
        await view.refresh()
        [seen] = view.nodes()
        assert (seen.incarnation, seen.address) == (new.node_info.incarnation, "127.0.0.1:2222")
        await old.stop()  # a late stop of the old incarnation must not delete the new entry
        await view.refresh()
        assert [n.incarnation for n in view.nodes()] == [new.node_info.incarnation]
        await new.stop()
        await view.stop()

    asyncio.run(body())


def test_malformed_entry_is_ignored(redis_url):
    async def body():
        client = redis.Redis.from_url(redis_url)
        client.set(node_key("junk"), b"{not json")
        registration = NodeRegistration(redis_url, make_node(), EngineLoad, **FAST)
        await registration.start()
        view = RegistryView(redis_url, ttl_s=1.0)
        assert await view.refresh()
        assert [n.node_id for n in view.nodes()] == ["prefill-0"]
        await registration.stop()
        await view.stop()
        client.close()

    asyncio.run(body())


class FakeProbe:
    """The gateway's health checker as the view sees it: answers for the node_ids in `alive`."""

    def __init__(self, *alive: str):
        self.alive = set(alive)
        self.asked: list[list[str]] = []

    async def __call__(self, nodes: list[NodeInfo]) -> set[str]:
        self.asked.append([node.node_id for node in nodes])
        return {node.node_id for node in nodes} & self.alive


def kill_redis(server: EmbeddedRedis) -> None:
    os.kill(server.pid, signal.SIGKILL)
    wait_until_true(lambda: server.poll() is not None)


def wait_until_true(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met before the timeout"
        time.sleep(0.02)


def test_view_keeps_its_snapshot_while_redis_is_stopped_and_the_node_keeps_beating():
    async def body(server: EmbeddedRedis):
        registration = NodeRegistration(server.url, make_node(), EngineLoad, **FAST)
        view = RegistryView(server.url, refresh_s=0.05, ttl_s=1.0)
        await registration.start()
        await view.start()
        os.kill(server.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            started = time.monotonic()
            while time.monotonic() - started < 2.0:  # twice the TTL: every entry would have expired
                assert [n.node_id for n in view.nodes()] == ["prefill-0"]
                await asyncio.sleep(0.1)
            assert await view.refresh() is False
            assert [n.node_id for n in view.nodes()] == ["prefill-0"]
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert registration._heartbeat.running() and view._refresher.running()  # both loops still retrying
        await wait_for(lambda v: v.get("prefill-0").updated_at > time.time() - 0.5, view)  # beating again
        await registration.stop()
        await view.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))


def test_while_redis_is_down_the_view_drops_only_the_nodes_that_stop_answering():
    async def body(server: EmbeddedRedis):
        nodes = [make_node("prefill-0"), make_node("decode-0", "decode"), make_node("decode-1", "decode")]
        for node in nodes:
            await NodeRegistration(server.url, node, EngineLoad, **FAST).beat()
        probe = FakeProbe("prefill-0", "decode-0", "decode-1")
        view = RegistryView(server.url, ttl_s=1.0, probe=probe)
        assert await view.refresh()
        assert probe.asked == []  # Redis vouches for the nodes: no direct checks
        kill_redis(server)
        assert await view.refresh() is False
        assert [n.node_id for n in view.nodes()] == ["decode-0", "decode-1", "prefill-0"]
        probe.alive.discard("decode-1")  # died during the outage
        await asyncio.sleep(1.2)  # past the TTL: the survivors' age does not matter
        assert await view.refresh() is False
        assert [n.node_id for n in view.nodes()] == ["decode-0", "prefill-0"]
        assert sorted(probe.asked[-1]) == ["decode-0", "decode-1", "prefill-0"]
        await view.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))


def test_after_redis_restarts_empty_live_nodes_are_kept_until_they_reregister():
    async def body(server: EmbeddedRedis):
        registrations = [
            NodeRegistration(server.url, make_node(node_id, role), EngineLoad, **FAST)
            for node_id, role in [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]
        ]
        for registration in registrations:
            await registration.beat()  # one beat each; this test beats by hand
        view = RegistryView(server.url, ttl_s=1.0, probe=FakeProbe("prefill-0", "decode-0"))
        assert await view.refresh()
        kill_redis(server)
        assert await view.refresh() is False
        assert server.restart()  # empty, on the same port
        assert await view.refresh()  # Redis holds no node yet: the ones that answer stay
        assert [n.node_id for n in view.nodes()] == ["decode-0", "prefill-0"]
        await asyncio.sleep(1.1)  # the grace of one TTL after the outage ends
        assert await registrations[0].beat()  # the client reconnects by itself
        assert await view.refresh()
        assert [n.node_id for n in view.nodes()] == ["prefill-0"]  # Redis alone decides again
        await view.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))


def test_without_an_outage_a_node_that_leaves_redis_leaves_the_view_at_once(redis_url):
    async def body():
        registration = NodeRegistration(redis_url, make_node(), EngineLoad, **FAST)
        probe = FakeProbe("prefill-0")
        view = RegistryView(redis_url, ttl_s=1.0, probe=probe)
        await registration.start()
        assert await view.refresh() and len(view.nodes()) == 1
        await registration.stop()
        assert await view.refresh() and view.nodes() == []
        assert probe.asked == []
        await view.stop()

    asyncio.run(body())


def test_node_reregisters_after_redis_restarts_empty():
    async def body(server: EmbeddedRedis):
        registration = NodeRegistration(server.url, make_node(), EngineLoad, **FAST)
        await registration.start()
        kill_redis(server)
        await asyncio.sleep(0.3)  # a few failed beats
        assert server.restart()
        view = RegistryView(server.url, ttl_s=1.0)
        await wait_for(lambda v: [n.node_id for n in v.nodes()] == ["prefill-0"], view)
        assert view.get("prefill-0").incarnation == registration.node_info.incarnation  # the same process
        await registration.stop()
        await view.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))
