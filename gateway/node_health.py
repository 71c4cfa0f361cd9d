"""Direct health checks of nodes, for when Redis cannot vouch for them.

Every node serves the standard gRPC health service (pdserve/node.py marks it SERVING once its
servicers run, NOT_SERVING while it shuts down). While Redis is unreachable the registry view
holds the last snapshot it read and asks `NodeHealthChecker.answering` which of its nodes still
answer; the view drops the others (pdserve/cluster_state/registry.py, `RegistryView`).

A node counts as gone after `max_failures` failed checks in a row, not one: on a loaded machine
one check can miss its deadline, and dropping the only node of a role would fail every request
(503), while routing one more request to a dead node costs only a retry on another.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster_state.registry import NodeInfo
from protos.tls import open_channel

logger = logging.getLogger(__name__)

# A restarted node may come back at the same address: retry connecting within a second, not
# after gRPC's default backoff of up to two minutes. A node whose host or container is gone
# answers no SYN: give up connecting after 2 s (gRPC's default is 20 s), so that a request routed
# to it in the registry's TTL fails over at once.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 2000),  # despite its name: the minimum connect timeout
]


class NodeHealthChecker:
    """Checks nodes over gRPC (TLS with `credentials`); mutates only its channels and its count of
    failures per node."""

    def __init__(
        self, timeout_s: float = 1.0, max_failures: int = 2, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures must be at least 1, got {max_failures}")
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._node_id_to_failures: Counter[str] = Counter()

    async def answering(self, nodes: list[NodeInfo]) -> set[str]:
        """Checks `nodes` at once; the node_ids of those not failed `max_failures` checks in a row."""
        results = await asyncio.gather(*(self.is_serving(node) for node in nodes))
        for node, serving in zip(nodes, results):
            if serving:
                self._node_id_to_failures.pop(node.node_id, None)
                continue
            self._node_id_to_failures[node.node_id] += 1
            if self._node_id_to_failures[node.node_id] == self.max_failures:
                logger.warning("%s node %s at %s does not answer health checks", node.role, node.node_id, node.address)
        return {node.node_id for node in nodes if self._node_id_to_failures[node.node_id] < self.max_failures}

    async def is_serving(self, node: NodeInfo) -> bool:
        """One check: the node answered SERVING within `timeout_s`."""
        stub = health_pb2_grpc.HealthStub(self._channel(node.address))
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self._credentials, CHANNEL_OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
