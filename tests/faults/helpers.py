"""What the fault tests check after every fault: the registry's view of the nodes, and that
nothing stays counted, reserved or held (gateway in-flight counts, nodes' pending transfers
and free blocks). The waits are generous: a drained cluster passes at once, and on a loaded
2-core CI machine a node's registry entry can lag its state by seconds."""

from __future__ import annotations

import redis

from pdserve.cluster_state.registry import KEY_PREFIX, NodeInfo
from pdserve.launcher import Launcher
from tests.e2e.helpers import metric_samples, wait_until


def node_infos(redis_url: str) -> dict[str, NodeInfo]:
    """node_id -> the node's registry entry, as Redis holds it now."""
    client = redis.Redis.from_url(redis_url)
    infos = (NodeInfo.from_json(client.get(key)) for key in client.scan_iter(f"{KEY_PREFIX}*"))
    return {info.node_id: info for info in infos}


def is_idle(info: NodeInfo) -> bool:
    return info.load.num_pending_transfers == 0 and info.load.num_free_blocks == info.capacity.num_blocks


def wait_until_nodes_idle(cluster: Launcher, num_nodes: int, dead_node: str | None = None) -> None:
    """Every live node (a killed node's entry lingers until its TTL) reports no pending transfer
    and all blocks free."""

    def idle() -> bool:
        live = [info for node_id, info in node_infos(cluster.redis_url).items() if node_id != dead_node]
        return len(live) == num_nodes and all(is_idle(info) for info in live)

    wait_until(idle, 30, f"{num_nodes} live nodes to report no pending transfer and all blocks free")


def wait_until_drained(cluster: Launcher, num_nodes: int, dead_node: str | None = None) -> None:
    """The gateway counts nothing in flight, then every live node is idle."""

    def gateway_drained() -> bool:
        return not any(value for _, value in metric_samples(cluster.base_url, "pdserve_gateway_in_flight_requests"))

    wait_until(gateway_drained, 30, "the gateway's in-flight counts to return to 0")
    wait_until_nodes_idle(cluster, num_nodes, dead_node)
