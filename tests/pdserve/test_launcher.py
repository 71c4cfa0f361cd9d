"""The launcher with fake children: tiny scripts that speak the per-component CLI contract."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, free_port
from pdserve.cluster_state.registry import RegistryView
from pdserve.launch_plan import ChildSpec, LaunchPlan, RestartPolicy, RestartSchedule, default_command, threads_per_node
from pdserve.launcher import EMBEDDED_REDIS, Launcher, LaunchError
from tests.pdserve.cluster_state.test_embedded_redis import pid_alive

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Parses the node flags of the contract (and prints any others), registers in Redis, leaves on SIGTERM.
FAKE_NODE = """
import argparse, asyncio, signal
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeRegistration

parser = argparse.ArgumentParser()
parser.add_argument("role")
for flag in ("--model", "--host", "--port", "--redis-url", "--node-id", "--num-threads"):
    parser.add_argument(flag, required=True)
args, extra = parser.parse_known_args()
print(f"fake {args.role} {args.node_id} num_threads={args.num_threads} extra={' '.join(extra)}", flush=True)

async def main():
    capacity = NodeCapacity(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    address = f"{args.host}:{args.port}"
    info = NodeInfo(node_id=args.node_id, role=args.role, address=address, model=args.model, capacity=capacity)
    registration = NodeRegistration(args.redis_url, info, lambda: info.load, interval_s=0.2, ttl_s=1.0)
    await registration.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await registration.stop()

asyncio.run(main())
"""

# Parses the gateway flags; GET /health answers 200 with the nodes registered in Redis per role,
# or (with --blind) with none, like a gateway that has not seen them yet.
FAKE_GATEWAY = """
import argparse, collections, http.server, json, redis

parser = argparse.ArgumentParser()
parser.add_argument("role")
for flag in ("--model", "--host", "--port", "--redis-url"):
    parser.add_argument(flag, required=True)
parser.add_argument("--blind", action="store_true")
args = parser.parse_args()
client = redis.Redis.from_url(args.redis_url)

def num_nodes():
    keys = [] if args.blind else list(client.scan_iter("pdserve:node:*"))
    return collections.Counter(json.loads(value)["role"] for value in client.mget(keys) if value) if keys else {}

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "num_nodes": num_nodes()}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass

http.server.HTTPServer((args.host, int(args.port)), Health).serve_forever()
"""

CRASH = "import sys; print('boom: weights not found', flush=True); sys.exit(3)"
IGNORE_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring SIGTERM', flush=True); "
    "time.sleep(60)"
)


@pytest.fixture
def fakes(tmp_path):
    """command_for that runs the fake scripts instead of `python -m pdserve.cli`, with overrides per child name."""
    (tmp_path / "fake_node.py").write_text(FAKE_NODE)
    (tmp_path / "fake_gateway.py").write_text(FAKE_GATEWAY)

    def make(overrides: dict[str, str] | None = None):
        def command_for(spec: ChildSpec) -> list[str]:
            if overrides and spec.name in overrides:
                return [sys.executable, "-c", overrides[spec.name]]
            script = tmp_path / ("fake_node.py" if spec.is_node else "fake_gateway.py")
            return [sys.executable, str(script)] + default_command(spec)[3:]  # drop "python -m pdserve.cli"

        return command_for

    return make


@pytest.fixture(autouse=True)
def importable_repo(monkeypatch):
    # The fake scripts import pdserve.cluster_state.registry; children inherit this environment.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def registered_node_ids(redis_url: str) -> list[str]:
    async def read():
        view = RegistryView(redis_url)
        await view.refresh()
        await view.stop()
        return [info.node_id for info in view.nodes()]

    return asyncio.run(read())


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
