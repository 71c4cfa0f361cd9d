"""The launcher with fake children: restarts of dead nodes, the embedded Redis and the gateway, and `run_up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cluster_state.embedded_redis import free_port
from pdserve.launch_plan import LaunchPlan, RestartPolicy, RestartSchedule
from pdserve.launcher import EMBEDDED_REDIS, Launcher
from tests.pdserve.cluster_state.test_embedded_redis import pid_alive
from tests.pdserve.launcher_fakes import registered_node_ids

pytestmark = pytest.mark.timeout(120)


FAST_RESTARTS = RestartPolicy(initial_delay_s=0.2, max_delay_s=1.0)


def restarted_within(cluster: Launcher, timeout_s: float = 10) -> tuple[list[str], float]:
    """Runs the supervisor's rounds until one restarts something: (what it restarted, seconds it took)."""
    started = time.monotonic()
    while not (restarted := cluster.restart_dead()):
        assert time.monotonic() - started < timeout_s, "nothing was restarted"
        time.sleep(0.05)
    return restarted, time.monotonic() - started


def test_restart_policy_doubles_the_delay_of_quick_deaths_up_to_the_cap():
    policy = RestartPolicy(initial_delay_s=1.0, max_delay_s=5.0, stable_after_s=60.0)
    assert policy.next_delay_s(None, ran_s=0.5) == 1.0  # the first death
    assert [policy.next_delay_s(previous, ran_s=2.0) for previous in (1.0, 2.0, 4.0)] == [2.0, 4.0, 5.0]
    assert policy.next_delay_s(5.0, ran_s=60.0) == 1.0  # it ran long enough: healthy again
    with pytest.raises(ValueError, match="initial_delay_s"):
        RestartPolicy(initial_delay_s=0.0)
    schedule = RestartSchedule(policy)
    assert schedule.died("decode-0", ran_s=1.0, now=100.0) == 1.0
    assert schedule.died("decode-0", ran_s=1.0, now=101.0) == 2.0 and schedule.is_pending("decode-0")
    assert schedule.pop_due(102.9) == [] and schedule.pop_due(103.0) == ["decode-0"]
    assert not schedule.is_pending("decode-0") and schedule.pop_due(200.0) == []


def test_a_dead_node_is_restarted_after_the_backoff_on_a_fresh_port(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), log_dir=str(tmp_path / "logs"), restart_policy=FAST_RESTARTS)
    with Launcher(plan, command_for=fakes()) as cluster:
        old = cluster.child("prefill-0")
        cluster.send_signal("prefill-0", signal.SIGKILL)
        restarted, took_s = restarted_within(cluster)
        new = cluster.child("prefill-0")
        assert restarted == ["prefill-0"] and took_s >= 0.2
        assert new.process.pid != old.process.pid and new.spec.port != old.spec.port
        assert not pid_alive(old.process.pid)  # reaped, not a zombie
        deadline = time.monotonic() + 10
        while cluster.log("prefill-0").count("fake prefill prefill-0") != 2:  # one log, appended
            assert time.monotonic() < deadline, "the restarted node never logged"
            time.sleep(0.05)
        while registered_node_ids(cluster.redis_url) != ["decode-0", "prefill-0"]:
            assert time.monotonic() < deadline, "the restarted node never registered"
            time.sleep(0.1)
        assert cluster.restart_dead() == []


def test_a_node_stopped_on_purpose_is_not_restarted(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), log_dir=str(tmp_path / "logs"), restart_policy=FAST_RESTARTS)
    with Launcher(plan, command_for=fakes()) as cluster:
        cluster.stop_child("decode-0", signal.SIGKILL)
        time.sleep(0.3)
        assert cluster.restart_dead() == []


def test_a_dead_embedded_redis_and_gateway_are_restarted_on_their_ports(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), log_dir=str(tmp_path / "logs"), restart_policy=FAST_RESTARTS)
    with Launcher(plan, command_for=fakes()) as cluster:
        redis_url, redis_pid = cluster.redis_url, cluster.embedded_redis.pid
        os.kill(redis_pid, signal.SIGKILL)
        cluster.send_signal("gateway", signal.SIGKILL)
        restarted = set(restarted_within(cluster)[0])
        while restarted != {EMBEDDED_REDIS, "gateway"}:
            restarted |= set(restarted_within(cluster)[0])
        assert cluster.redis_url == redis_url and cluster.embedded_redis.pid != redis_pid
        assert not pid_alive(redis_pid)  # reaped, not a zombie
        deadline = time.monotonic() + 10
        while registered_node_ids(redis_url) != ["decode-0", "prefill-0"]:  # the nodes re-register
            assert time.monotonic() < deadline, "the nodes never re-registered"
            time.sleep(0.1)
        while httpx_status(cluster.health_url) != 200:
            assert time.monotonic() < deadline, "the gateway never came back"
            time.sleep(0.1)


def httpx_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


RUN_UP = """
import sys
from pathlib import Path
from pdserve.launcher import LaunchPlan, default_command, run_up
from pdserve.log_setup import setup_logging

here = Path(__file__).parent

def command_for(spec):
    script = here / ("fake_node.py" if spec.is_node else "fake_gateway.py")
    return [sys.executable, str(script)] + default_command(spec)[3:]

setup_logging()
sys.exit(run_up(LaunchPlan(model="m", port=int(sys.argv[1])), command_for))
"""


def test_run_up_prints_ready_and_stops_cleanly_on_sigterm(fakes, tmp_path):
    fakes()  # writes the fake scripts
    (tmp_path / "run_up.py").write_text(RUN_UP)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(tmp_path / "run_up.py"), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout.readline() == f"ready on http://127.0.0.1:{port}\n"
        children = pids_running("fake_", str(tmp_path))
        assert len(children) >= 3  # two fake nodes, one fake gateway (plus redis, not matched)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert all(not pid_alive(pid) for pid in children)


def test_run_up_restarts_a_killed_node_and_a_killed_redis(fakes, tmp_path):
    fakes()  # writes the fake scripts
    (tmp_path / "run_up.py").write_text(RUN_UP)
    stderr = tmp_path / "run_up.log"
    port = free_port()
    with open(stderr, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(tmp_path / "run_up.py"), str(port)], stdout=subprocess.PIPE, stderr=log, text=True
        )
    try:
        assert process.stdout.readline() == f"ready on http://127.0.0.1:{port}\n"
        [node_pid] = pids_running("fake_node.py", "prefill-0", str(tmp_path))
        [redis_pid] = pids_running("redis-server", parent=process.pid)
        os.kill(node_pid, signal.SIGKILL)
        os.kill(redis_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (
            pids_running("fake_node.py", "prefill-0", str(tmp_path))
            and pids_running("redis-server", parent=process.pid)
        ):
            assert time.monotonic() < deadline, "pdserve up did not restart the node and Redis"
            time.sleep(0.1)
        assert "restarting prefill-0" in stderr.read_text() and "restarting the embedded redis" in stderr.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def pids_running(*parts: str, parent: int | None = None) -> list[int]:
    """Live (not zombie) processes whose command line holds every one of `parts`, and whose parent
    is `parent` if given (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        in_parent = parent is None or int(ppid) == parent
        if entry.name.isdigit() and state != "Z" and in_parent and all(part in cmdline for part in parts):
            pids.append(int(entry.name))
    return pids
