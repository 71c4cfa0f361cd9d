"""A whole cluster on one machine, one process per node: what `pdserve up`, the benchmarks and the
end-to-end tests run. The one supervisor of pdserve's processes.

Lifecycle:
    1. start(): embedded Redis (unless the plan names one), then one child per node (prefill and
       decode, or a single colocated node) on free 127.0.0.1 ports, then the gateway
    2. wait_ready(): every node registered in Redis at its port, and the gateway's /health answers
       200 counting every registered node (it has seen them all); a child that exits first stops
       everything and raises LaunchError with its exit code
    3. while it runs: start_node() adds a named node and returns once it is registered and the
       gateway counts it; send_signal() and stop_child() reach one child by its PID; log() reads
       one child's log
    4. serve_until_stopped() (`pdserve up`): until SIGINT/SIGTERM (run_up installs the handlers),
       restart_dead() every POLL_S: a child that died (node or gateway) or the embedded Redis is
       started again after a backoff (`RestartPolicy`); Redis on its port, so every URL stays
       valid; a node on a fresh port, so no gateway channel to the old one stalls it
    5. stop(): SIGTERM (and SIGCONT, for a child stopped by SIGSTOP) each child, SIGKILL what is
       left after the grace period, stop embedded Redis

`with Launcher(plan) as cluster:` runs 1 and 2 on entry and 5 on exit, exception or not.

Each child writes stdout and stderr to its own file, `<log_dir>/<name>.log`, so an error can quote
the tail of the one that failed. log_dir is a temp dir unless the plan names one; the temp dir is
removed after a clean stop and kept (and named in the log) when a child or the `with` body failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, die_with_parent
from pdserve.cluster_state.registry import NodeInfo, RegistryView
from pdserve.launch_plan import ChildSpec, LaunchPlan, RestartSchedule, default_command, distinct_free_ports

logger = logging.getLogger(__name__)

POLL_S = 0.25
EMBEDDED_REDIS = "embedded redis"  # its name in the restart schedule, beside the children's


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
    started_at: float = field(default_factory=time.monotonic)
    exit_handled: bool = False  # its exit was reported, or asked for (stop_child): not restarted

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"


class Launcher:
    """Owns the children of one plan (and the embedded Redis): starts them, waits on them,
    signals them by PID and stops them; see the module docstring for the lifecycle. Not for use
    inside a running event loop (its waits run one of their own)."""

    def __init__(
        self,
        plan: LaunchPlan,
        command_for: Callable[[ChildSpec], list[str]] = default_command,
        stop_grace_s: float = 10.0,
    ):
        self.plan = plan
        self.command_for = command_for
        self.stop_grace_s = stop_grace_s
        self._restarts = RestartSchedule(plan.restart_policy)
        self._redis_started_at = 0.0
        self.redis_url: str | None = plan.redis_url
        self.children: list[Child] = []
        self.log_dir: Path | None = None
        self.embedded_redis: EmbeddedRedis | None = None  # None: the plan names its own Redis
        self._stop_requested = threading.Event()
        self._failed = False

    def __enter__(self) -> Launcher:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._failed = self._failed or exc_type is not None  # keep the logs of a failed run
        self.stop()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def request_stop(self) -> None:
        """Safe from a signal handler: only sets a flag that the wait loops poll."""
        self._stop_requested.set()

    @property
    def base_url(self) -> str:
        """The gateway's, as a client on this machine reaches it."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.plan.host, self.plan.host)
        return f"http://{host}:{self.plan.port}"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"

    def start(self) -> None:
        ensure_port_free(self.plan.host, self.plan.port)
        self.log_dir = Path(self.plan.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.redis_url is None:
                self.embedded_redis = EmbeddedRedis().start()
                self._redis_started_at = time.monotonic()
                self.redis_url = self.embedded_redis.url
            for spec in self.child_specs():
                self._spawn(spec)
        except BaseException:
            self._failed = True
            self.stop()
            raise
        logger.info("started %d children; logs in %s", len(self.children), self.log_dir)

    def child_specs(self) -> list[ChildSpec]:
        return self.plan.child_specs(self.redis_url)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the cluster serves; on failure stop everything and raise LaunchError."""
        try:
            self._wait_for(self.children, timeout_s or self.plan.ready_timeout_s)
        except BaseException:
            self._failed = self._failed or not self.stop_requested  # keep logs unless merely interrupted
            self.stop()
            raise

    def start_node(self, role: str, name: str, *flags: str, timeout_s: float | None = None) -> Child:
        """After wait_ready: one more node, returned once it is registered and the gateway counts it.

        A name may be used again once its child has exited (a restart); the new child's log is
        appended to the same file. Raises LaunchError if the node exits or times out first; the
        rest of the cluster keeps running either way.
        """
        previous = self.find(name)
        if previous is not None and previous.process.poll() is None:
            raise ValueError(f"{name} is still running; stop it first or pick another name")
        child = self._spawn(self.plan.node_spec(role, name, self._free_node_port(), self.redis_url, flags))
        self._wait_for([child], timeout_s or self.plan.ready_timeout_s)
        return child

    def find(self, name: str) -> Child | None:
        """The latest child of that name (a restarted node replaces the one before), or None."""
        return next((child for child in reversed(self.children) if child.spec.name == name), None)

    def child(self, name: str) -> Child:
        child = self.find(name)
        if child is None:
            raise KeyError(f"no child named {name!r}; children: {', '.join(c.spec.name for c in self.children)}")
        return child

    def send_signal(self, name: str, sig: int) -> None:
        """Signals one child by its PID (SIGSTOP, SIGCONT, ...); the launcher does not wait for it."""
        self.child(name).process.send_signal(sig)

    def stop_child(self, name: str, sig: int = signal.SIGTERM) -> int:
        """Sends `sig` to one child, waits for it to exit (SIGKILL after the grace period), returns its code."""
        child = self.child(name)
        child.exit_handled = True  # asked for: restart_dead leaves it stopped
        child.process.send_signal(sig)
        return self._reap(child)

    def log(self, name: str) -> str:
        """Everything that child (and any earlier one of that name) wrote so far."""
        return self.child(name).log_path.read_text(errors="replace")

    def serve_until_stopped(self) -> int:
        """After wait_ready: restarts whatever dies (restart_dead) until stop is requested; returns 0."""
        while not self._stop_requested.wait(POLL_S):
            self.restart_dead()
        return 0

    def restart_dead(self) -> list[str]:
        """One round of supervision: schedules a restart of each child, and of the embedded Redis,
        found dead, and starts again those whose backoff has passed; returns their names. Call it
        from the thread that started the children (see die_with_parent)."""
        now = time.monotonic()
        for child in self._newly_exited():
            self._failed = True  # keep the logs
            name, code, tail = child.spec.name, child.process.returncode, child.log_tail()
            delay_s = self._restarts.died(name, now - child.started_at, now)
            logger.error("%s exited with code %s; restarting it in %.1f s; last lines:\n%s", name, code, delay_s, tail)
        redis_code = self.embedded_redis.poll() if self.embedded_redis is not None else None
        if redis_code is not None and not self._restarts.is_pending(EMBEDDED_REDIS):
            delay_s = self._restarts.died(EMBEDDED_REDIS, now - self._redis_started_at, now)
            logger.error("embedded redis exited with code %s; restarting it in %.1f s", redis_code, delay_s)
        due = self._restarts.pop_due(now)
        for name in due:
            self._restart(name)
        return due

    def stop(self) -> None:
        """Idempotent. Gateway first, so it stops taking requests before its nodes go."""
        alive = [child for child in reversed(self.children) if child.process.poll() is None]
        if alive:
            logger.info("stopping %s", ", ".join(child.spec.name for child in alive))
        for child in alive:
            child.process.terminate()
            child.process.send_signal(signal.SIGCONT)  # a stopped child acts on SIGTERM only once continued
        deadline = time.monotonic() + self.stop_grace_s
        for child in alive:
            self._reap(child, deadline)
        if self.embedded_redis is not None:
            self.embedded_redis.stop()
            self.embedded_redis = None
        self._clean_log_dir()

    def _reap(self, child: Child, deadline: float | None = None) -> int:
        """Waits for one signalled child until `deadline` (default: the grace period), then kills it."""
        timeout_s = self.stop_grace_s if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return child.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) is still running; killing it", child.spec.name, child.process.pid)
            child.process.kill()
            return child.process.wait()

    def _spawn(self, spec: ChildSpec) -> Child:
        log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(spec.env)}  # unbuffered: a crash's last words get logged
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
        child = Child(spec, process, log_path)
        self.children.append(child)
        logger.info("started %s (pid %d) on %s:%d", spec.name, process.pid, spec.host, spec.port)
        return child

    def _wait_for(self, children: list[Child], timeout_s: float) -> None:
        """Until `children` are up and the gateway has seen every registered node; raises LaunchError."""
        asyncio.run(self._poll_until_up(children, timeout_s))

    async def _poll_until_up(self, children: list[Child], timeout_s: float) -> None:
        view = RegistryView(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                raise_if_exited(children)
                if self.stop_requested:
                    raise LaunchError("stopped before the cluster was ready")
                missing = await self._missing(view, children)
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"not ready after {timeout_s:.0f} s, still waiting for {', '.join(missing)}; "
                        f"logs in {self.log_dir}"
                    )
                await asyncio.sleep(POLL_S)
        finally:
            await view.stop()

    async def _missing(self, view: RegistryView, children: list[Child]) -> list[str]:
        """What is not up yet: nodes not registered at their port, and the gateway's /health
        (not answering 200, or counting fewer nodes of some role than Redis holds)."""
        await view.refresh()
        node_id_to_port = {info.node_id: info.address.rsplit(":", 1)[-1] for info in view.nodes()}
        missing = [
            c.spec.name for c in children if c.spec.is_node and node_id_to_port.get(c.spec.name) != str(c.spec.port)
        ]
        if not await asyncio.to_thread(gateway_counts_all, self.health_url, view.nodes()):
            missing.append("gateway /health")
        return missing

    def _newly_exited(self) -> list[Child]:
        exited = [c for c in self.children if not c.exit_handled and c.process.poll() is not None]
        for child in exited:
            child.exit_handled = True
        return exited

    def _restart(self, name: str) -> None:
        if name == EMBEDDED_REDIS:
            logger.warning("restarting the %s on port %d", name, self.embedded_redis.port)
            self._redis_started_at = time.monotonic()
            self.embedded_redis.restart()  # if it fails, the next round finds it dead and backs off further
            return
        if self.child(name).process.poll() is None:
            return  # start_node brought it back meanwhile
        logger.warning("restarting %s", name)
        spec = self.child(name).spec
        if spec.is_node:  # a fresh port: the gateway's channel to the old one may be backing off
            spec = replace(spec, port=self._free_node_port())
        self._spawn(spec)

    def _free_node_port(self) -> int:
        """A free port that no running child holds (or is about to bind)."""
        busy = [child.spec.port for child in self.children if child.process.poll() is None]
        return distinct_free_ports(1, busy)[0]

    def _clean_log_dir(self) -> None:
        if self.log_dir is None or self.plan.log_dir is not None:
            return
        if self._failed:
            logger.info("child logs kept in %s", self.log_dir)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        self.log_dir = None


def raise_if_exited(children: list[Child]) -> None:
    for child in children:
        returncode = child.process.poll()
        if returncode is not None:
            raise LaunchError(
                f"{child.spec.name} exited with code {returncode} before the cluster was ready; "
                f"last lines of {child.log_path}:\n{child.log_tail()}",
                child_name=child.spec.name,
                returncode=returncode,
            )


def gateway_counts_all(health_url: str, nodes: list[NodeInfo]) -> bool:
    """The gateway is healthy and its /health counts at least `nodes` per role: it has seen them."""
    body = http_json(health_url)
    if body is None:
        return False
    num_nodes = body.get("num_nodes", {})
    return all(num_nodes.get(role, 0) >= count for role, count in Counter(info.role for info in nodes).items())


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


def http_json(url: str, timeout_s: float = 1.0) -> dict | None:
    """The JSON body of a 200 answer; None for any other answer, or none."""
    # No proxies: an http_proxy in the environment must not intercept a local health check.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def run_up(plan: LaunchPlan, command_for: Callable[[ChildSpec], list[str]] = default_command) -> int:
    """`pdserve up`: start, wait until ready, serve until SIGINT/SIGTERM; returns the exit code."""
    launcher = Launcher(plan, command_for)
    previous = {sig: signal.signal(sig, lambda *_: launcher.request_stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with launcher:
            print(f"ready on http://{plan.host}:{plan.port}", flush=True)
            return launcher.serve_until_stopped()
    except LaunchError as error:
        logger.error("%s", error)
        return 130 if launcher.stop_requested else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
