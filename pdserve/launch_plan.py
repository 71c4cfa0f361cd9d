"""What the launcher starts: the plan of a cluster on one machine (its nodes, named
`<role>-<index>`, and the gateway), each child process's spec and command line (the
per-component CLI contract: `pdserve <role> --model ... --port ...`), and when `pdserve up`
starts again a child (or the embedded Redis) that died (`RestartPolicy`, `RestartSchedule`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cluster_state.embedded_redis import free_port
from pdserve.cluster_state.registry import NODE_ROLES

NODE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class RestartPolicy:
    """The delay before restarting what died doubles with each quick death, from
    `initial_delay_s` up to `max_delay_s`: a child that cannot start (bad flags, port taken)
    is retried without a busy loop. One that ran `stable_after_s` counts as healthy again."""

    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0

    def __post_init__(self):
        if not 0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError("restart delays need 0 < initial_delay_s <= max_delay_s")

    def next_delay_s(self, previous_delay_s: float | None, ran_s: float) -> float:
        if previous_delay_s is None or ran_s >= self.stable_after_s:
            return self.initial_delay_s
        return min(self.max_delay_s, previous_delay_s * 2)


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
    gateway_env: tuple[tuple[str, str], ...] = ()  # (name, value) added to the gateway's environment: secrets
    node_env: tuple[tuple[str, str], ...] = ()  # (name, value) added to every node's environment: secrets
    ready_timeout_s: float = 300.0
    log_dir: str | None = None
    num_threads: int | None = None  # torch threads per node; None: the machine's cores split between the nodes
    restart_policy: RestartPolicy = RestartPolicy()  # `pdserve up` restarting what died

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
        gateway = ChildSpec(
            "gateway", "gateway", self.model, self.host, self.port, redis_url, None, self.gateway_args, self.gateway_env
        )
        return specs + [gateway]

    def node_spec(self, role: str, name: str, port: int, redis_url: str, flags: Sequence[str] = ()) -> ChildSpec:
        """A node with the plan's node flags (and prefill flags for a prefill node), then `flags`."""
        if role not in NODE_ROLES:
            raise ValueError(f"role {role!r} is not a node role; pick one of {', '.join(NODE_ROLES)}")
        num_nodes = 1 if self.colocated else self.num_prefill + self.num_decode
        num_threads = self.num_threads or threads_per_node(num_nodes)
        args = self.node_args + (self.prefill_args if role == "prefill" else ()) + tuple(flags)
        return ChildSpec(name, role, self.model, NODE_HOST, port, redis_url, num_threads, args, self.node_env)


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
    env: tuple[tuple[str, str], ...] = ()  # added to the inherited environment (secrets stay out of `ps`)

    @property
    def is_node(self) -> bool:
        return self.role != "gateway"


class RestartSchedule:
    """When each dead thing (by name) is due to start again; mutates only its own records."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._name_to_delay_s: dict[str, float] = {}  # the delay its last restart waited
        self._name_to_due_at: dict[str, float] = {}  # monotonic time of a pending restart

    def died(self, name: str, ran_s: float, now: float) -> float:
        """Schedules a restart of `name`, which ran `ran_s` before it died; returns the delay."""
        delay_s = self.policy.next_delay_s(self._name_to_delay_s.get(name), ran_s)
        self._name_to_delay_s[name] = delay_s
        self._name_to_due_at[name] = now + delay_s
        return delay_s

    def is_pending(self, name: str) -> bool:
        return name in self._name_to_due_at

    def pop_due(self, now: float) -> list[str]:
        """The names whose restart is due, in the order they died; they are no longer pending."""
        due = [name for name, due_at in self._name_to_due_at.items() if due_at <= now]
        for name in due:
            del self._name_to_due_at[name]
        return due


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
