"""Faults the launcher's supervisor and the Redis outage handling absorb, on a running cluster
(tiny model, real processes). Redis stopped, then killed: every request sent meanwhile succeeds,
because the gateway routes with the last registry it read and checks the nodes directly; when
Redis is back (the launcher restarts a killed one, empty, on its port) every node registers
again and the KV index is rebuilt. A killed node: the launcher starts it again and it serves.
Nothing is left in flight afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import redis

from pdserve.cluster_state.kv_index import kv_index_key
from pdserve.cluster_state.registry import DEFAULT_TTL_S, KEY_PREFIX, NodeInfo
from pdserve.launcher import EMBEDDED_REDIS, Launcher
from tests.e2e.helpers import e2e_plan, healthy, metric_samples, wait_until
from tests.factories import build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)

PAUSE_S = 10.0  # the outage: every registry entry would have expired three times over
# Long enough for full KV blocks (16 tokens) in the prefix cache, so the KV index has entries.
PROMPT = "Tell me, in a few words, why the sea is salty and the sky is blue on a clear summer day. " * 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    with Launcher(e2e_plan(model, tmp_path_factory.mktemp("logs"))) as running:
        yield running


class Traffic:
    """Completions and /health checks, one after another on a thread, until stop(); records
    each answer's status (or the error) and when it was sent."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.results: list[tuple[float, str, int | str]] = []  # (sent at, what, status or error)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic")

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopping.set()
        self._thread.join()

    def sent_between(self, start: float, end: float) -> list[tuple[str, int | str]]:
        return [(what, status) for sent_at, what, status in self.results if start <= sent_at <= end]

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            while not self._stopping.is_set():
                self._send(client, "completion", lambda: client.post("/v1/completions", json=body))
                self._send(client, "health", lambda: client.get("/health"))

    def _send(self, client: httpx.Client, what: str, call) -> None:
        sent_at = time.monotonic()
        try:
            status: int | str = call().status_code
        except httpx.HTTPError as error:
            status = repr(error)
        self.results.append((sent_at, what, status))


def registered(redis_url: str) -> dict[str, NodeInfo]:
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=1)
        return {info.node_id: info for info in map(NodeInfo.from_json, client.mget(client.keys(f"{KEY_PREFIX}*")))}
    except redis.RedisError:
        return {}


def assert_everything_reregistered(cluster: Launcher, before: dict[str, NodeInfo], since: float) -> None:
    """The same node incarnations (nothing restarted) beat again, and each prefill node's KV index
    holds its prefix cache again."""

    def back() -> bool:
        now = registered(cluster.redis_url)
        return {n: i.incarnation for n, i in now.items()} == {n: i.incarnation for n, i in before.items()} and all(
            info.updated_at > since for info in now.values()
        )

    wait_until(back, 15, "every node to register again")
    client = redis.Redis.from_url(cluster.redis_url)
    prefill_keys = [kv_index_key(i.node_id, i.incarnation) for i in before.values() if i.role == "prefill"]
    wait_until(lambda: all(client.scard(key) > 0 for key in prefill_keys), 15, "the KV index to be rebuilt")


def assert_nothing_in_flight(cluster: Launcher) -> None:
    def gateway_in_flight() -> list[float]:
        return [value for _, value in metric_samples(cluster.base_url, "pdserve_gateway_in_flight_requests") if value]

    def nodes_pending() -> list[str]:
        return [i.node_id for i in registered(cluster.redis_url).values() if i.load.num_pending_transfers]

    wait_until(lambda: not gateway_in_flight(), 10, "the gateway's in-flight counts to drop to 0")
    wait_until(lambda: not nodes_pending(), 10, "no pending KV transfers on any node")


def test_redis_stopped_longer_than_the_ttl_fails_no_request(cluster):
    before = registered(cluster.redis_url)
    redis_pid = cluster.embedded_redis.pid
    with Traffic(cluster.base_url) as traffic:
        time.sleep(0.5)
        stopped_at = time.monotonic()
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        resumed_at, resumed_wall = time.monotonic(), time.time()
        time.sleep(1.0)
    during = traffic.sent_between(stopped_at, resumed_at)
    late = traffic.sent_between(stopped_at + DEFAULT_TTL_S + 1.0, resumed_at)  # when the old view gave 503
    assert [result for result in traffic.results if result[2] != 200] == []
    assert len(late) >= 2 and {what for what, _ in during} == {"completion", "health"}
    assert_everything_reregistered(cluster, before, since=resumed_wall)
    assert_nothing_in_flight(cluster)


def test_redis_killed_and_restarted_by_the_launcher_fails_no_request(cluster):
    before = registered(cluster.redis_url)
    old_pid = cluster.embedded_redis.pid
    with Traffic(cluster.base_url) as traffic:
        time.sleep(0.5)
        os.kill(old_pid, signal.SIGKILL)
        restarted = wait_until(cluster.restart_dead, 15, "the launcher to restart Redis", interval_s=0.05)
        back_wall = time.time()
        time.sleep(2.0)  # requests while the nodes re-register
    assert restarted == [EMBEDDED_REDIS] and cluster.embedded_redis.pid != old_pid
    assert [result for result in traffic.results if result[2] != 200] == []
    assert len(traffic.results) >= 4
    assert_everything_reregistered(cluster, before, since=back_wall)
    assert_nothing_in_flight(cluster)


def test_a_killed_node_is_restarted_by_the_launcher_and_serves_again(cluster):
    old = cluster.child("decode-0")
    old_incarnation = registered(cluster.redis_url)["decode-0"].incarnation
    cluster.send_signal("decode-0", signal.SIGKILL)
    assert wait_until(cluster.restart_dead, 15, "the launcher to restart decode-0", interval_s=0.05) == ["decode-0"]
    new = cluster.child("decode-0")
    assert new.process.pid != old.process.pid and old.process.poll() == -signal.SIGKILL

    def serving_again() -> bool:
        info = registered(cluster.redis_url).get("decode-0")
        return info is not None and info.incarnation != old_incarnation and info.address.endswith(f":{new.spec.port}")

    wait_until(serving_again, 120, "the restarted decode-0 to register")
    wait_until(lambda: healthy(cluster.base_url), 10, "the gateway to route to it")
    with Traffic(cluster.base_url) as traffic:
        wait_until(lambda: len(traffic.results) >= 4, 60, "requests through the restarted node")
    assert [result for result in traffic.results if result[2] != 200] == []
    assert_nothing_in_flight(cluster)
