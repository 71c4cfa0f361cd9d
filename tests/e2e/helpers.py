"""Starting and stopping pdserve's real processes for end-to-end tests (127.0.0.1 only)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster_state.embedded_redis import EmbeddedRedis, free_port
from pdserve.cluster_state.registry import node_key

REPO_ROOT = Path(__file__).resolve().parents[2]


class ProcessGroup:
    """Children started by one test module; each is stopped by its own PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.processes[name] = process
        return process

    def start_node(self, role: str, name: str, model: str, redis_url: str, *extra: str) -> subprocess.Popen:
        return self.start(
            name,
            role,
            "--model",
            model,
            "--redis-url",
            redis_url,
            "--node-id",
            name,
            "--num-threads",
            "1",
            "--kv-cache-gib",
            "0.05",
            *extra,
        )

    def start_gateway(self, model: str, redis_url: str, *extra: str) -> str:
        port = free_port()
        self.start("gateway", "gateway", "--model", model, "--port", str(port), "--redis-url", redis_url, *extra)
        return f"http://127.0.0.1:{port}"

    def start_cluster(self, model: str, redis_url: str, nodes: Sequence[tuple[str, ...]], *gateway_args: str) -> str:
        """Starts `(role, name, *flags)` nodes and the gateway; returns the gateway's URL once
        every node is registered in Redis and the gateway is healthy."""
        for role, name, *extra in nodes:
            self.start_node(role, name, model, redis_url, *extra)
        base_url = self.start_gateway(model, redis_url, *gateway_args)
        client = redis.Redis.from_url(redis_url)
        names = [node[1] for node in nodes]
        wait_until(lambda: all(client.exists(node_key(name)) for name in names), 120, f"{len(names)} nodes to register")
        wait_until(lambda: healthy(base_url), 60, "the gateway to be healthy")
        return base_url

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop(self, name: str, sig: int = signal.SIGTERM) -> int:
        process = self.processes.pop(name)
        process.send_signal(sig)
        try:
            return process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_cluster(model: str, log_dir: Path, nodes: Sequence[tuple[str, ...]], *gateway_args: str) -> Iterator[dict]:
    """An embedded Redis, `(role, name, *flags)` nodes and a gateway, stopped on exit; yields
    {"model", "redis_url", "base_url", "group"} once the gateway has seen every node."""
    group = ProcessGroup(log_dir)
    with EmbeddedRedis() as embedded:
        try:
            base_url = group.start_cluster(model, embedded.url, nodes, *gateway_args)
            time.sleep(1.0)  # the gateway's registry snapshot refreshes every 0.5 s: let it see them all
            yield {"model": model, "redis_url": embedded.url, "base_url": base_url, "group": group}
        finally:
            group.stop_all()


def metric_samples(base_url: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """The gateway's samples of one Prometheus metric whose labels include `labels`."""
    text = httpx.get(f"{base_url}/metrics", timeout=5, follow_redirects=True).text
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]


def routed_counts(base_url: str, role: str) -> dict[str, float]:
    """Requests the gateway sent to each node of a role."""
    return {
        labels["node_id"]: value
        for labels, value in metric_samples(base_url, "pdserve_gateway_routed_requests_total", role=role)
    }
