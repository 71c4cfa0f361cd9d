"""What the launcher starts: the plan of a cluster on one machine (its nodes, named
`<role>-<index>`, and the gateway), and each child process's spec and command line (the
per-component CLI contract: `pdserve <role> --model ... --port ...`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cluster_state.embedded_redis import free_port
from pdserve.cluster_state.registry import NODE_ROLES

NODE_HOST = "127.0.0.1"


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
    num_threads: int | None = None  # torch threads per node; None: the machine's cores split between the nodes

    def __post_init__(self):
        if not self.colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a disaggregated cluster needs num_prefill >= 1 and num_decode >= 1 (or colocated=True)")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range 1-65535")
        if self.ready_timeout_s <= 0:
            raise ValueError("ready_timeout_s must be positive")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be at least 1 (or None to split the cores)")

    def child_specs(self, redis_url: str) -> list[ChildSpec]:
        """The nodes, named `<role>-<index>` (on distinct free ports), then the gateway."""
        roles = ["colocated"] if self.colocated else ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        role_counts: dict[str, int] = {}
        specs = []
        for role, port in zip(roles, distinct_free_ports(len(roles))):
            index = role_counts[role] = role_counts.get(role, -1) + 1
            specs.append(self.node_spec(role, f"{role}-{index}", port, redis_url))
        gateway = ChildSpec("gateway", "gateway", self.model, self.host, self.port, redis_url, None, self.gateway_args)
        return specs + [gateway]

    def node_spec(self, role: str, name: str, port: int, redis_url: str, flags: Sequence[str] = ()) -> ChildSpec:
        """A node with the plan's node flags (and prefill flags for a prefill node), then `flags`."""
        if role not in NODE_ROLES:
            raise ValueError(f"role {role!r} is not a node role; pick one of {', '.join(NODE_ROLES)}")
        num_nodes = 1 if self.colocated else self.num_prefill + self.num_decode
        num_threads = self.num_threads or threads_per_node(num_nodes)
        args = self.node_args + (self.prefill_args if role == "prefill" else ()) + tuple(flags)
        return ChildSpec(name, role, self.model, NODE_HOST, port, redis_url, num_threads, args)


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


def distinct_free_ports(count: int, busy: Sequence[int] = ()) -> list[int]:
    """`count` free ports, none of them in `busy` (ports children hold, or will once they bind)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(NODE_HOST)
        if port not in ports and port not in busy:  # the OS may hand back a port it just gave us
            ports.append(port)
    return ports
