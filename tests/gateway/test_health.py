"""GET /health's body: the nodes the backend's registry snapshot holds, per role."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.cluster_state.registry import NodeCapacity, NodeInfo
from tests.gateway.fakes import FakeBackend

CAPACITY = NodeCapacity(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)


@dataclass
class FakeRegistry:
    infos: list[NodeInfo]

    def nodes(self, role: str | None = None) -> list[NodeInfo]:
        return [info for info in self.infos if role is None or info.role == role]


@dataclass
class FakeClusterBackend(FakeBackend):
    registry: FakeRegistry | None = None


def node(node_id: str, role: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, address="127.0.0.1:1", model="m", capacity=CAPACITY)


@pytest.fixture
def backend(backend) -> FakeClusterBackend:
    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    registry = FakeRegistry([node(node_id, role) for node_id, role in roles.items()])
    return FakeClusterBackend(backend.script, registry=registry)


def test_health_counts_the_registered_nodes_per_role(client, backend):
    assert client.get("/health").json() == {"status": "ok", "num_nodes": {"prefill": 1, "decode": 2}}
    backend.registry.infos.pop()  # a node left the snapshot
    assert client.get("/health").json()["num_nodes"] == {"prefill": 1, "decode": 1}


def test_health_of_a_backend_without_a_registry_counts_nothing(client, backend):
    backend.registry = None
    assert client.get("/health").json() == {"status": "ok", "num_nodes": {}}
