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

import pytest

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, free_port
from pdserve.cluster_state.registry import RegistryView
from pdserve.launcher import ChildSpec, Launcher, LaunchError, LaunchPlan, default_command, threads_per_node
from tests.pdserve.cluster_state.test_embedded_redis import pid_alive

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Parses exactly the node flags of the contract, registers in Redis, leaves on SIGTERM.
FAKE_NODE = """
import argparse, asyncio, signal
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeLoad, NodeRegistration

parser = argparse.ArgumentParser()
parser.add_argument("role")
for flag in ("--model", "--host", "--port", "--redis-url", "--node-id", "--num-threads"):
    parser.add_argument(flag, required=True)
args = parser.parse_args()
print(f"fake {args.role} {args.node_id} num_threads={args.num_threads}", flush=True)

async def main():
    capacity = NodeCapacity(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    address = f"{args.host}:{args.port}"
    info = NodeInfo(node_id=args.node_id, role=args.role, address=address, model=args.model, capacity=capacity)
    registration = NodeRegistration(args.redis_url, info, NodeLoad, interval_s=0.2, ttl_s=1.0)
    await registration.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await registration.stop()

asyncio.run(main())
"""

# Parses the gateway flags and answers GET /health with 200.
FAKE_GATEWAY = """
import argparse, http.server

parser = argparse.ArgumentParser()
parser.add_argument("role")
for flag in ("--model", "--host", "--port", "--redis-url"):
    parser.add_argument(flag, required=True)
args = parser.parse_args()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *_):
        pass

http.server.HTTPServer((args.host, int(args.port)), Health).serve_forever()
"""

CRASH = "import sys; print('boom: weights not found', flush=True); sys.exit(3)"
IGNORE_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


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


def test_threads_are_split_between_nodes():
    assert threads_per_node(3, cpu_count=16) == 5
    assert threads_per_node(2, cpu_count=2) == 1
    assert threads_per_node(4, cpu_count=2) == 1  # never zero


def test_plan_rejects_an_empty_disaggregated_cluster():
    with pytest.raises(ValueError, match="num_decode >= 1"):
        LaunchPlan(model="m", num_decode=0)
    LaunchPlan(model="m", num_prefill=0, num_decode=0, colocated=True)


def test_child_specs_and_default_commands():
    plan = LaunchPlan(
        model="m",
        host="0.0.0.0",
        port=9000,
        num_prefill=2,
        num_decode=1,
        redis_url="redis://r:1/0",
        node_args=("--kv-cache-gib", "0.5"),
    )
    specs = Launcher(plan).child_specs()
    assert [(s.name, s.role) for s in specs] == [
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
        ("gateway", "gateway"),
    ]
    node_ports = [s.port for s in specs[:3]]
    assert len(set(node_ports)) == 3 and all(s.host == "127.0.0.1" for s in specs[:3])
    assert specs[0].num_threads == threads_per_node(3)
    assert default_command(specs[2]) == [
        sys.executable,
        "-m",
        "pdserve.cli",
        "decode",
        "--model",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(node_ports[2]),
        "--redis-url",
        "redis://r:1/0",
        "--node-id",
        "decode-0",
        "--num-threads",
        str(threads_per_node(3)),
        "--kv-cache-gib",
        "0.5",
    ]
    assert default_command(specs[3]) == [
        sys.executable,
        "-m",
        "pdserve.cli",
        "gateway",
        "--model",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--redis-url",
        "redis://r:1/0",
    ]


def test_colocated_plan_runs_one_node():
    plan = LaunchPlan(model="m", colocated=True, redis_url="redis://r:1/0")
    specs = Launcher(plan).child_specs()
    assert [(s.name, s.role) for s in specs] == [("colocated-0", "colocated"), ("gateway", "gateway")]
    assert specs[0].num_threads == threads_per_node(1)


def test_ready_then_stop_ends_every_child_and_redis(fakes, tmp_path):
    plan = LaunchPlan(model="m", port=free_port(), num_prefill=2, num_decode=1, log_dir=str(tmp_path / "logs"))
    launcher = Launcher(plan, command_for=fakes())
    launcher.start()
    try:
        launcher.wait_ready(timeout_s=60)
        assert registered_node_ids(launcher.redis_url) == ["decode-0", "prefill-0", "prefill-1"]
        redis_pid = launcher._redis.pid
        pids = [child.process.pid for child in launcher.children]
    finally:
        launcher.stop()
    assert all(not pid_alive(pid) for pid in pids + [redis_pid])
    assert f"num_threads={threads_per_node(3)}" in (tmp_path / "logs" / "prefill-1.log").read_text()


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
        assert launcher._redis is None
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


def test_stop_kills_a_child_that_ignores_sigterm(fakes):
    plan = LaunchPlan(model="m", port=free_port(), colocated=True)
    launcher = Launcher(plan, command_for=fakes({"colocated-0": IGNORE_SIGTERM}), stop_grace_s=0.5)
    launcher.start()
    time.sleep(0.5)  # let it install its SIG_IGN
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
        children = child_pids_of(tmp_path)
        assert len(children) >= 3  # two fake nodes, one fake gateway (plus redis, not matched)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert all(not pid_alive(pid) for pid in children)


def child_pids_of(tmp_path: Path) -> list[int]:
    """PIDs whose command line runs one of this test's fake scripts (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and "fake_" in cmdline and str(tmp_path) in cmdline:
            pids.append(int(entry.name))
    return pids
