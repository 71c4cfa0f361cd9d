"""GET /health's body: the nodes the backend routes to, per role, from its registry snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.cluster_backend import ClusterBackend
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo

CAPACITY = NodeCapacity(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)


@dataclass
class FakeRegistry:
    infos: list[NodeInfo]

    def nodes(self, role: str | None = None) -> list[NodeInfo]:
        return [info for info in self.infos if role is None or info.role == role]


def node(node_id: str, role: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, address="127.0.0.1:1", model="m", capacity=CAPACITY)


def test_health_reports_the_backends_nodes_per_role(client, backend):
    backend.num_nodes = {"prefill": 1, "decode": 2}
    assert client.get("/health").json() == {"status": "ok", "num_nodes": {"prefill": 1, "decode": 2}}


def test_the_cluster_backend_counts_the_nodes_of_its_registry_snapshot():
    registry = FakeRegistry([node("prefill-0", "prefill"), node("decode-0", "decode"), node("decode-1", "decode")])
    backend = ClusterBackend(registry)
    assert backend.num_nodes_by_role() == {"prefill": 1, "decode": 2}
    registry.infos.pop()  # a node left the snapshot
    assert backend.num_nodes_by_role() == {"prefill": 1, "decode": 1}
    registry.infos.clear()
    assert backend.num_nodes_by_role() == {} and not backend.is_ready()
