"""Picks the nodes for a request from the registry snapshot: least loaded of each role.

Heartbeats refresh the registry's load once a second; between beats a burst of requests
would all see the same numbers and pile onto one node, so the router adds the requests it
has itself sent to each node and not yet seen finish (`in_flight`).
"""

from __future__ import annotations

from collections import Counter

from cluster.registry import NodeInfo, RegistryView


class Router:
    """Mutates only its in-flight counters."""

    def __init__(self, registry: RegistryView) -> None:
        self.registry = registry
        self.in_flight: Counter[str] = Counter()

    def candidates(self, role: str, exclude: set[str] = frozenset()) -> list[NodeInfo]:
        return [n for n in self.registry.nodes(role) if n.node_id not in exclude]

    def pick_prefill(self, exclude: set[str] = frozenset()) -> NodeInfo | None:
        nodes = self.candidates("prefill", exclude)
        return min(nodes, key=lambda n: (n.load.num_waiting_tokens + 1000 * self.in_flight[n.node_id], n.node_id), default=None)

    def pick_decode(self, role: str = "decode", exclude: set[str] = frozenset()) -> NodeInfo | None:
        nodes = self.candidates(role, exclude)
        return min(
            nodes,
            key=lambda n: (n.load.num_running + self.in_flight[n.node_id], -n.load.num_free_blocks, n.node_id),
            default=None,
        )

    def acquire(self, node: NodeInfo) -> None:
        self.in_flight[node.node_id] += 1

    def release(self, node: NodeInfo) -> None:
        self.in_flight[node.node_id] -= 1
        if self.in_flight[node.node_id] <= 0:
            del self.in_flight[node.node_id]
