"""A whole cluster on one machine, one process per node: what `pdserve up` runs.

Lifecycle:
    1. start(): embedded Redis (unless the plan names one), then one child per node (prefill and
       decode, or a single colocated node) on free 127.0.0.1 ports, then the gateway
    2. wait_ready(): every node registered in Redis at its port, and the gateway's /health answers
       200; a child that exits first stops everything and raises LaunchError with its exit code
    3. serve_until_stopped(): until SIGINT/SIGTERM (run_up installs the handlers) or the gateway dies
    4. stop(): SIGTERM each child, SIGKILL what is left after the grace period, stop embedded Redis

Each child writes stdout and stderr to its own file, `<log_dir>/<name>.log`, so an error can quote
the tail of the one that failed. log_dir is a temp dir unless the plan names one; the temp dir is
removed after a clean stop and kept (and named in the log) when a child failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, die_with_parent, free_port
from pdserve.cluster_state.registry import RegistryView

logger = logging.getLogger(__name__)

NODE_HOST = "127.0.0.1"
POLL_S = 0.25


@dataclass(frozen=True)
class LaunchPlan:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    redis_url: str | None = None  # None: start an embedded Redis
    colocated: bool = False  # one colocated node instead of prefill + decode nodes
    node_args: tuple[str, ...] = ()  # appended to every node's command (engine flags)
    prefill_args: tuple[str, ...] = ()  # appended after node_args for prefill nodes only
    gateway_args: tuple[str, ...] = ()  # appended to the gateway's command
    ready_timeout_s: float = 300.0
    log_dir: str | None = None

    def __post_init__(self):
        if not self.colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a disaggregated cluster needs num_prefill >= 1 and num_decode >= 1 (or colocated=True)")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range 1-65535")
        if self.ready_timeout_s <= 0:
            raise ValueError("ready_timeout_s must be positive")


@dataclass(frozen=True)
class ChildSpec:
    """One child process: a node (name is its node_id) or the gateway (name "gateway")."""

    name: str
    role: str  # "prefill" | "decode" | "colocated" | "gateway"
    model: str
    host: str
    port: int
    redis_url: str
    num_threads: int | None  # None for the gateway
    extra_args: tuple[str, ...] = ()

    @property
    def is_node(self) -> bool:
        return self.role != "gateway"


def default_command(spec: ChildSpec) -> list[str]:
    """`pdserve <role> ...` in this interpreter, per the per-component CLI contract."""
    argv = [sys.executable, "-m", "pdserve.cli", spec.role, "--model", spec.model, "--host", spec.host]
    argv += ["--port", str(spec.port), "--redis-url", spec.redis_url]
    if spec.is_node:
        argv += ["--node-id", spec.name, "--num-threads", str(spec.num_threads)]
    return argv + list(spec.extra_args)


def threads_per_node(num_nodes: int, cpu_count: int | None = None) -> int:
    """Cores split evenly so torch in each node does not oversubscribe the machine."""
    return max(1, (cpu_count or os.cpu_count() or 1) // num_nodes)


class LaunchError(RuntimeError):
    def __init__(self, message: str, child_name: str | None = None, returncode: int | None = None):
        super().__init__(message)
        self.child_name = child_name
        self.returncode = returncode


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen
    log_path: Path
    reported_exit: bool = False

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"


class Launcher:
    def __init__(
        self,
        plan: LaunchPlan,
        command_for: Callable[[ChildSpec], list[str]] = default_command,
        stop_grace_s: float = 10.0,
    ):
        self.plan = plan
        self.command_for = command_for
        self.stop_grace_s = stop_grace_s
        self.redis_url: str | None = plan.redis_url
        self.children: list[Child] = []
        self.log_dir: Path | None = None
        self._redis: EmbeddedRedis | None = None
        self._stop_requested = threading.Event()
        self._failed = False

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def request_stop(self) -> None:
        """Safe from a signal handler: only sets a flag that the wait loops poll."""
        self._stop_requested.set()

    def start(self) -> None:
        ensure_port_free(self.plan.host, self.plan.port)
        self.log_dir = Path(self.plan.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.redis_url is None:
                self._redis = EmbeddedRedis().start()
                self.redis_url = self._redis.url
            for spec in self.child_specs():
                self._spawn(spec)
        except BaseException:
            self._failed = True
            self.stop()
            raise
        logger.info("started %d children; logs in %s", len(self.children), self.log_dir)

    def child_specs(self) -> list[ChildSpec]:
        """The nodes (on distinct free ports), then the gateway."""
        plan = self.plan
        roles = ["colocated"] if plan.colocated else ["prefill"] * plan.num_prefill + ["decode"] * plan.num_decode
        num_threads = threads_per_node(len(roles))
        ports = distinct_free_ports(len(roles))
        role_counts: dict[str, int] = {}
        specs = []
        for role, port in zip(roles, ports):
            index = role_counts[role] = role_counts.get(role, -1) + 1
            name = f"{role}-{index}"
            args = plan.node_args + (plan.prefill_args if role == "prefill" else ())
            specs.append(ChildSpec(name, role, plan.model, NODE_HOST, port, self.redis_url, num_threads, args))
        gateway = ChildSpec(
            "gateway", "gateway", plan.model, plan.host, plan.port, self.redis_url, None, plan.gateway_args
        )
        return specs + [gateway]

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the cluster serves; on failure stop everything and raise LaunchError."""
        try:
            asyncio.run(self._wait_ready(timeout_s or self.plan.ready_timeout_s))
        except BaseException:
            self._failed = self._failed or not self.stop_requested  # keep logs unless merely interrupted
            self.stop()
            raise

    def serve_until_stopped(self) -> int:
        """After wait_ready: 0 once stop is requested, 1 if the gateway exits on its own.

        A node that dies is reported but not fatal: the gateway routes around it.
        """
        while not self._stop_requested.wait(POLL_S):
            for child in self._newly_exited():
                self._failed = True
                logger.error(
                    "%s exited with code %s; last lines:\n%s",
                    child.spec.name,
                    child.process.returncode,
                    child.log_tail(),
                )
                if not child.spec.is_node:
                    return 1
        return 0

    def stop(self) -> None:
        """Idempotent. Gateway first, so it stops taking requests before its nodes go."""
        alive = [child for child in reversed(self.children) if child.process.poll() is None]
        if alive:
            logger.info("stopping %s", ", ".join(child.spec.name for child in alive))
        for child in alive:
            child.process.terminate()
        deadline = time.monotonic() + self.stop_grace_s
        for child in alive:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) ignored SIGTERM for %.0f s; killing it",
                    child.spec.name,
                    child.process.pid,
                    self.stop_grace_s,
                )
                child.process.kill()
                child.process.wait()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        self._clean_log_dir()

    def _spawn(self, spec: ChildSpec) -> None:
        log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # so a crash's last words reach the log
        if spec.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(spec.num_threads)  # caps threads before torch.set_num_threads runs
        with open(log_path, "ab") as log:
            # Own session: a terminal's Ctrl-C reaches only the launcher, which stops children in order.
            process = subprocess.Popen(
                self.command_for(spec),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.children.append(Child(spec, process, log_path))
        logger.info("started %s (pid %d) on %s:%d", spec.name, process.pid, spec.host, spec.port)

    async def _wait_ready(self, timeout_s: float) -> None:
        view = RegistryView(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self._raise_if_child_exited()
                if self.stop_requested:
                    raise LaunchError("stopped before the cluster was ready")
                missing = await self._missing(view)
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"not ready after {timeout_s:.0f} s, still waiting for {', '.join(missing)}; logs in {self.log_dir}"
                    )
                await asyncio.sleep(POLL_S)
        finally:
            await view.stop()

    async def _missing(self, view: RegistryView) -> list[str]:
        """What is not up yet: node_ids not registered at their port, and the gateway's health."""
        await view.refresh()
        node_id_to_port = {info.node_id: info.address.rsplit(":", 1)[-1] for info in view.nodes()}
        missing = [
            c.spec.name
            for c in self.children
            if c.spec.is_node and node_id_to_port.get(c.spec.name) != str(c.spec.port)
        ]
        if not await asyncio.to_thread(http_ok, self.health_url):
            missing.append("gateway /health")
        return missing

    @property
    def health_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.plan.host, self.plan.host)
        return f"http://{host}:{self.plan.port}/health"

    def _raise_if_child_exited(self) -> None:
        for child in self.children:
            returncode = child.process.poll()
            if returncode is not None:
                raise LaunchError(
                    f"{child.spec.name} exited with code {returncode} before the cluster was ready; "
                    f"last lines of {child.log_path}:\n{child.log_tail()}",
                    child_name=child.spec.name,
                    returncode=returncode,
                )

    def _newly_exited(self) -> list[Child]:
        exited = [c for c in self.children if not c.reported_exit and c.process.poll() is not None]
        for child in exited:
            child.reported_exit = True
        return exited

    def _clean_log_dir(self) -> None:
        if self.log_dir is None or self.plan.log_dir is not None:
            return
        if self._failed:
            logger.info("child logs kept in %s", self.log_dir)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        self.log_dir = None


def ensure_port_free(host: str, port: int) -> None:
    """Refuse a busy gateway port up front: something else answering /health would look ready."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does; TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as error:
            raise LaunchError(
                f"cannot use {host}:{port} for the gateway ({error}); free it or pick another --port"
            ) from error


def distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(NODE_HOST)
        if port not in ports:  # the OS may hand back a port it just gave us
            ports.append(port)
    return ports


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    # No proxies: an http_proxy in the environment must not intercept a local health check.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run_up(plan: LaunchPlan, command_for: Callable[[ChildSpec], list[str]] = default_command) -> int:
    """`pdserve up`: start, wait until ready, serve until SIGINT/SIGTERM; returns the exit code."""
    launcher = Launcher(plan, command_for)
    previous = {sig: signal.signal(sig, lambda *_: launcher.request_stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        launcher.wait_ready()
        print(f"ready on http://{plan.host}:{plan.port}", flush=True)
        return launcher.serve_until_stopped()
    except LaunchError as error:
        logger.error("%s", error)
        return 130 if launcher.stop_requested else 1
    finally:
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
