"""The prefill role's choices for the node runtime."""

from __future__ import annotations

import asyncio

from pdserve.cluster_state.embedded_redis import EmbeddedRedis
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeRegistration
from pdserve.engine.scheduler import EngineLoad
from prefill_service.server import PrefillNodeService, RegisteredDecodeNodes


def test_a_prefill_node_keeps_a_local_cache_and_pushes_from_its_layer_hook():
    service = PrefillNodeService("auto", kv_lease_s=10.0)
    assert service.kv_storage is None
    assert service.layer_hook == service.pushes.on_layer_computed
    assert service.kv_lease_s == 10.0  # its lease keeper's period until a decode node states its own


def test_registered_decode_nodes_are_those_of_the_signed_registry():
    async def scenario(redis_url: str) -> None:
        capacity = NodeCapacity(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)

        def node(node_id: str, role: str, port: int) -> NodeInfo:
            return NodeInfo(node_id=node_id, role=role, address=f"127.0.0.1:{port}", model="m", capacity=capacity)

        directory = RegisteredDecodeNodes(redis_url, cluster_secret="s3cret")
        decode = NodeRegistration(redis_url, node("decode-0", "decode", 1001), EngineLoad, secret="s3cret")
        prefill = NodeRegistration(redis_url, node("prefill-0", "prefill", 1002), EngineLoad, secret="s3cret")
        unsigned = NodeRegistration(redis_url, node("decode-x", "decode", 1003), EngineLoad)
        for registration in (prefill, unsigned):
            await registration.start()
        try:
            assert not await directory.is_decode_node("127.0.0.1:1001")
            await decode.start()  # registered after the directory's first read: looked up again
            assert await directory.is_decode_node("127.0.0.1:1001")
            assert not await directory.is_decode_node("127.0.0.1:1002")  # a prefill node
            assert not await directory.is_decode_node("127.0.0.1:1003")  # not signed with the secret
            await decode.drain()  # stopping: it still awaits the pages of what it reserved
            await directory.view.refresh()
            assert await directory.is_decode_node("127.0.0.1:1001")
        finally:
            for registration in (decode, prefill, unsigned):
                await registration.stop()
            await directory.close()

    with EmbeddedRedis() as redis:
        asyncio.run(scenario(redis.url))
