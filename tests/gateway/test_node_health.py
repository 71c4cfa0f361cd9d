"""Direct gRPC health checks of nodes (gateway/node_health.py), against real health servers, and
the registry view that uses them while Redis is away."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.node_health import NodeHealthChecker
from pdserve.cluster_state.embedded_redis import EmbeddedRedis, free_port
from pdserve.cluster_state.registry import NodeRegistration, RegistryView
from pdserve.engine.scheduler import EngineLoad
from tests.pdserve.cluster_state.test_registry import make_node

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServer:
    """A gRPC server with only the standard health service, as every node serves it."""

    def __init__(self) -> None:
        self.server = grpc.aio.server()
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def start(self, status=SERVING) -> HealthServer:
        await self.server.start()
        await self.servicer.set("", status)
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=None)


def test_a_node_is_dropped_after_max_failures_in_a_row_and_back_once_it_answers():
    async def body():
        live = await HealthServer().start()
        node, dead = make_node("decode-0", "decode", live.port), make_node("decode-1", "decode", free_port())
        checker = NodeHealthChecker(timeout_s=0.5, max_failures=2)
        try:
            assert await checker.answering([node, dead]) == {"decode-0", "decode-1"}  # one miss is forgiven
            assert await checker.answering([node, dead]) == {"decode-0"}
            assert await checker.answering([dead]) == set()
            await live.servicer.set("", NOT_SERVING)  # shutting down: as good as gone
            assert await checker.answering([node]) == {"decode-0"}
            assert await checker.answering([node]) == set()
            await live.servicer.set("", SERVING)
            assert await checker.answering([node]) == {"decode-0"}  # one answer resets the count
            assert await checker.answering([node]) == {"decode-0"}
        finally:
            await checker.close()
            await live.stop()

    asyncio.run(body())


def test_checks_run_at_once_and_a_silent_node_costs_one_timeout():
    async def body():
        live = await HealthServer().start()
        checker = NodeHealthChecker(timeout_s=0.3, max_failures=1)
        with socket.socket() as silent, socket.socket() as also_silent:
            for sock in (silent, also_silent):  # accepts connections, never speaks: a stopped process
                sock.bind(("127.0.0.1", 0))
                sock.listen()
            ports = [live.port, silent.getsockname()[1], also_silent.getsockname()[1], free_port()]
            nodes = [make_node(f"prefill-{i}", port=port) for i, port in enumerate(ports)]
            try:
                started = time.monotonic()
                assert await checker.answering(nodes) == {"prefill-0"}
                assert time.monotonic() - started < 0.9  # not one timeout per silent node
            finally:
                await checker.close()
                await live.stop()

    asyncio.run(body())


def test_max_failures_must_be_positive():
    with pytest.raises(ValueError, match="max_failures"):
        NodeHealthChecker(max_failures=0)


def test_the_registry_view_keeps_the_nodes_that_answer_while_redis_is_down():
    async def body(server: EmbeddedRedis):
        live = await HealthServer().start()
        doomed = await HealthServer().start()
        checker = NodeHealthChecker(timeout_s=0.5, max_failures=1)
        view = RegistryView(server.url, ttl_s=1.0, probe=checker.answering)
        for node in [make_node("prefill-0", port=live.port), make_node("prefill-1", port=doomed.port)]:
            await NodeRegistration(server.url, node, EngineLoad, interval_s=0.1, ttl_s=1.0).beat()
        try:
            assert await view.refresh() and len(view.nodes()) == 2
            os.kill(server.pid, signal.SIGKILL)
            await doomed.stop()  # a node dies while Redis is away
            assert await view.refresh() is False
            assert [n.node_id for n in view.nodes()] == ["prefill-0"]
        finally:
            await view.stop()
            await checker.close()
            await live.stop()

    with EmbeddedRedis() as server:
        asyncio.run(body(server))
