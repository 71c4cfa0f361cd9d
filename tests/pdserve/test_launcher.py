"""The launcher with fake children: the `with` block, run-time nodes, signals, readiness and stop."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, free_port
from pdserve.launch_plan import LaunchPlan, threads_per_node
from pdserve.launcher import Launcher, LaunchError
from tests.pdserve.cluster_state.test_embedded_redis import pid_alive
from tests.pdserve.launcher_fakes import CRASH, IGNORE_SIGTERM, registered_node_ids

pytestmark = pytest.mark.timeout(120)


def test_with_block_runs_a_ready_cluster_and_stops_every_child_and_redis(fakes, tmp_path):
    plan = LaunchPlan(
        model="m",
        port=free_port(),
        num_prefill=2,
        num_decode=1,
        node_args=("--kv-cache-gib", "0.05"),
        prefill_args=("--max-num-batched-tokens", "32"),
        log_dir=str(tmp_path / "logs"),
    )
    with Launcher(plan, command_for=fakes()) as cluster:
        assert registered_node_ids(cluster.redis_url) == ["decode-0", "prefill-0", "prefill-1"]
        health = httpx.get(f"{cluster.base_url}/health").json()
        assert health["num_nodes"] == {"prefill": 2, "decode": 1}
        redis_pid = cluster.embedded_redis.pid
        pids = [child.process.pid for child in cluster.children]
        logs = {name: cluster.log(name) for name in ("prefill-1", "decode-0")}
    assert all(not pid_alive(pid) for pid in pids + [redis_pid])
    num_threads = threads_per_node(3)
    assert logs == {
        "prefill-1": f"fake prefill prefill-1 num_threads={num_threads} extra=--kv-cache-gib 0.05 "
        "--max-num-batched-tokens 32\n",
        "decode-0": f"fake decode decode-0 num_threads={num_threads} extra=--kv-cache-gib 0.05\n",
    }


def test_with_block_stops_everything_when_its_body_raises_and_keeps_the_logs(fakes):
    plan = LaunchPlan(model="m", port=free_port(), colocated=True, num_threads=1)  # default temp log dir
    with pytest.raises(RuntimeError, match="the body failed"), Launcher(plan, command_for=fakes()) as cluster:
        pids = [child.process.pid for child in cluster.children]
        log_dir = cluster.log_dir
        raise RuntimeError("the body failed")
    try:
        assert all(not pid_alive(pid) for pid in pids)
        assert (log_dir / "colocated-0.log").read_text() == "fake colocated colocated-0 num_threads=1 extra=\n"
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_start_node_adds_a_named_node_and_a_stopped_name_restarts(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), log_dir=str(tmp_path / "logs"), num_threads=1)
    with Launcher(plan, command_for=fakes()) as cluster:
        late = cluster.start_node("decode", "decode-late", "--kv-transport", "grpc")
        assert registered_node_ids(cluster.redis_url) == ["decode-0", "decode-late", "prefill-0"]
        assert httpx.get(f"{cluster.base_url}/health").json()["num_nodes"] == {"prefill": 1, "decode": 2}
        with pytest.raises(ValueError, match="decode-late is still running"):
            cluster.start_node("decode", "decode-late")
        assert cluster.stop_child("decode-late", signal.SIGKILL) == -signal.SIGKILL
        restarted = cluster.start_node("decode", "decode-late")
        assert cluster.child("decode-late") is restarted and restarted.process.pid != late.process.pid
        assert restarted.spec.port != late.spec.port
        assert cluster.log("decode-late") == (
            "fake decode decode-late num_threads=1 extra=--kv-transport grpc\n"
            "fake decode decode-late num_threads=1 extra=\n"
        )
        assert cluster.stop_child("decode-late") == 0  # SIGTERM: it deregisters and exits cleanly
        assert registered_node_ids(cluster.redis_url) == ["decode-0", "prefill-0"]


def test_a_node_that_dies_while_starting_raises_and_the_cluster_keeps_running(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), log_dir=str(tmp_path / "logs"))
    with Launcher(plan, command_for=fakes({"prefill-9": CRASH})) as cluster:
        with pytest.raises(LaunchError, match="prefill-9 exited with code 3") as caught:
            cluster.start_node("prefill", "prefill-9")
        assert (caught.value.child_name, caught.value.returncode) == ("prefill-9", 3)
        assert all(cluster.child(name).process.poll() is None for name in ("prefill-0", "decode-0", "gateway"))


def test_a_node_stopped_by_sigstop_still_stops_cleanly(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), colocated=True, log_dir=str(tmp_path / "logs"))
    cluster = Launcher(plan, command_for=fakes(), stop_grace_s=20)
    with cluster:
        node = cluster.child("colocated-0").process
        cluster.send_signal("colocated-0", signal.SIGSTOP)
        wait_for_state(node.pid, "T")
        cluster.send_signal("colocated-0", signal.SIGCONT)
        wait_for_state(node.pid, "S")
        cluster.send_signal("colocated-0", signal.SIGSTOP)
        wait_for_state(node.pid, "T")
        started = time.monotonic()
    assert node.returncode == 0  # SIGTERM handled once continued: not killed after the grace period
    assert time.monotonic() - started < 10


def wait_for_log(launcher: Launcher, name: str, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in launcher.log(name):
        assert time.monotonic() < deadline, f"{name} never logged {text!r}"
        time.sleep(0.05)


def wait_for_state(pid: int, state: str, timeout_s: float = 10) -> None:
    """Until /proc says the process is in `state` (T: stopped, S: sleeping)."""
    deadline = time.monotonic() + timeout_s
    while (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != state:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {state}"
        time.sleep(0.05)


def test_child_that_exits_early_fails_wait_ready_with_its_code_and_log(fakes):
    plan = LaunchPlan(model="m", port=free_port())  # default temp log dir: kept because a child failed
    launcher = Launcher(plan, command_for=fakes({"decode-0": CRASH}))
    launcher.start()
    pids = [child.process.pid for child in launcher.children]
    log_dir = launcher.log_dir
    try:
        with pytest.raises(LaunchError, match="decode-0 exited with code 3") as caught:
            launcher.wait_ready(timeout_s=60)
        assert (caught.value.child_name, caught.value.returncode) == ("decode-0", 3)
        assert "boom: weights not found" in str(caught.value)
        assert all(not pid_alive(pid) for pid in pids)  # wait_ready stopped the others
        assert launcher.embedded_redis is None
        assert (log_dir / "decode-0.log").exists()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_timeout_names_what_is_missing(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), log_dir=str(tmp_path / "logs"))
    launcher = Launcher(plan, command_for=fakes({"gateway": "import time; time.sleep(60)"}))
    launcher.start()
    with pytest.raises(LaunchError, match="still waiting for gateway /health"):
        launcher.wait_ready(timeout_s=1.5)
    assert all(not pid_alive(child.process.pid) for child in launcher.children)


def test_a_healthy_gateway_that_has_not_seen_the_nodes_is_not_ready(fakes, tmp_path):
    logs = tmp_path / "logs"
    plan = LaunchPlan(model="m", port=free_port(), gateway_args=("--blind",), ready_timeout_s=3, log_dir=str(logs))
    launcher = Launcher(plan, command_for=fakes())
    with pytest.raises(LaunchError, match=f"still waiting for gateway /health; logs in {logs}"):
        launcher.__enter__()  # what `with` runs first; it stops the cluster itself when it raises
    assert all(not pid_alive(child.process.pid) for child in launcher.children)


def test_stop_kills_a_child_that_ignores_sigterm(fakes):
    plan = LaunchPlan(model="m", port=free_port(), colocated=True)
    launcher = Launcher(plan, command_for=fakes({"colocated-0": IGNORE_SIGTERM}), stop_grace_s=0.5)
    launcher.start()
    wait_for_log(launcher, "colocated-0", "ignoring SIGTERM")
    stubborn, log_dir = launcher.children[0].process, launcher.log_dir
    launcher.stop()
    assert stubborn.returncode == -signal.SIGKILL
    assert not log_dir.exists()  # a clean stop removes the temp log dir


def test_busy_gateway_port_is_refused_before_anything_starts(fakes):
    with EmbeddedRedis() as busy:  # any listener will do
        plan = LaunchPlan(model="m", port=busy.port, redis_url=busy.url)
        launcher = Launcher(plan, command_for=fakes())
        with pytest.raises(LaunchError, match="pick another --port"):
            launcher.start()
        assert launcher.children == [] and launcher.log_dir is None
