"""What the end-to-end tests share besides the launcher that runs their clusters: a test plan,
bounded waits on real conditions, and readers of the gateway's /health and /metrics."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster_state.embedded_redis import free_port
from pdserve.launch_plan import LaunchPlan

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_ARGS = ("--kv-cache-gib", "0.05")  # tiny models: a small KV cache starts fast


def e2e_plan(model: str, log_dir: Path, **fields) -> LaunchPlan:
    """A cluster on the gateway's free port with one torch thread per node (2 CPUs shared by all)."""
    fields["node_args"] = NODE_ARGS + tuple(fields.get("node_args", ()))
    return LaunchPlan(model=model, port=free_port(), num_threads=1, ready_timeout_s=180, log_dir=str(log_dir), **fields)


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


def gateway_num_nodes(base_url: str) -> dict[str, int]:
    """Nodes per role in the gateway's registry snapshot, as its /health counts them."""
    return httpx.get(f"{base_url}/health", timeout=5).json().get("num_nodes", {})


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
