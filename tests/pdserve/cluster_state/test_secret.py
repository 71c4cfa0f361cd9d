"""The cluster secret: signed registry entries, the gRPC interceptors, and a Redis with a password."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cluster_state.embedded_redis import EmbeddedRedis
from pdserve.cluster_state.kv_index import KvIndexPublisher, KvIndexReader
from pdserve.cluster_state.registry import NodeRegistration, RegistryView
from pdserve.cluster_state.secret import (
    ClusterSecretServerInterceptor,
    call_metadata,
    client_interceptors,
    sign_entry,
    verify_entry,
)
from pdserve.engine.block_hash import hash_token_blocks
from pdserve.engine.scheduler import EngineLoad
from tests.pdserve.cluster_state.test_kv_index import FakeEngineCache
from tests.pdserve.cluster_state.test_registry import FAST, make_node

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-of-this-cluster"


@pytest.fixture
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def test_signature_covers_every_field_and_the_secret():
    signed = sign_entry({"node_id": "decode-0", "address": "127.0.0.1:1", "load": {"n": 1.5}}, SECRET)
    assert verify_entry(signed, SECRET)
    assert verify_entry(json.loads(json.dumps(signed)), SECRET)  # survives the JSON round trip
    assert not verify_entry(signed, "another secret")
    assert not verify_entry({**signed, "address": "10.0.0.9:1"}, SECRET)
    assert not verify_entry({**signed, "extra": 1}, SECRET)
    assert not verify_entry({key: value for key, value in signed.items() if key != "signature"}, SECRET)
    assert not verify_entry({**signed, "signature": 7}, SECRET)
    assert not verify_entry(["not", "an", "object"], SECRET)


def test_signed_node_info_reads_back_as_the_same_node():
    info = make_node()
    entry = json.loads(info.to_json(SECRET))
    assert verify_entry(entry, SECRET)
    assert type(info).model_validate(entry) == info
    assert "signature" not in json.loads(info.to_json())


def test_view_with_the_secret_ignores_unsigned_and_forged_entries(redis_url, caplog):
    real, fake = make_node("decode-0", "decode", 50051), make_node("decode-fake", "decode", 50099)
    client = redis.Redis.from_url(redis_url)
    client.set(fake.key, fake.to_json())  # written by someone without the secret
    forged = {**json.loads(real.to_json(SECRET)), "node_id": "decode-forged", "address": "127.0.0.1:50098"}
    client.set("pdserve:node:decode-forged", json.dumps(forged))  # a real entry's signature on other fields

    async def body():
        registration = NodeRegistration(redis_url, real, EngineLoad, secret=SECRET, **FAST)
        view, open_view = RegistryView(redis_url, secret=SECRET), RegistryView(redis_url)
        await registration.start()
        try:
            for _ in range(3):  # warned once per entry, not once per refresh
                assert await view.refresh()
            assert [node.node_id for node in view.nodes()] == ["decode-0"]
            assert await open_view.refresh()  # without a secret: open, as before
            assert {node.node_id for node in open_view.nodes()} == {"decode-0", "decode-fake", "decode-forged"}
        finally:
            await registration.stop()
            await view.stop()
            await open_view.stop()

    with caplog.at_level(logging.WARNING, logger="pdserve.cluster_state.registry"):
        asyncio.run(body())
    warnings = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert len(warnings) == 2 and any("decode-fake" in w for w in warnings)


def test_registry_and_kv_index_work_with_a_redis_password():
    node = make_node("prefill-0")
    hashes = hash_token_blocks(list(range(32)), 16, "tiny")
    with EmbeddedRedis(password="pa ss/word") as server:
        assert server.url.startswith("redis://:pa%20ss%2Fword@127.0.0.1:")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).set("k", "v")

        async def body():
            registration = NodeRegistration(server.url, node, EngineLoad, secret=SECRET, **FAST)
            view = RegistryView(server.url, secret=SECRET)
            publisher = KvIndexPublisher(server.url, node, FakeEngineCache(hashes).changes, ttl_s=2.0, interval_s=0.05)
            reader = KvIndexReader(server.url)
            await registration.start()
            await publisher.start()
            try:
                assert await view.refresh()
                assert [info.node_id for info in view.nodes()] == ["prefill-0"]
                assert await reader.cached_prefix_blocks([node], hashes) == {"prefill-0": 2}
            finally:
                await publisher.stop()
                await reader.close()
                await registration.stop()
                await view.stop()

        asyncio.run(body())


async def _echo(request, context):
    return request


async def _echo_stream(request, context):
    yield request
    yield request


async def _join(request_iterator, context):
    return b"".join([item async for item in request_iterator])


GENERIC = grpc.method_handlers_generic_handler(
    "test.Echo",
    {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_echo_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_join),
    },
)


async def _calls(channel: grpc.aio.Channel) -> dict[str, object]:
    """Each kind of call on `channel`: its answer, or the status code it failed with."""

    async def outcome(call) -> object:
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            return error.code()

    async def streamed() -> object:
        try:
            return [item async for item in channel.unary_stream("/test.Echo/ServerStream")(b"x")]
        except grpc.aio.AioRpcError as error:
            return error.code()

    health_call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return {
        "unary": await outcome(channel.unary_unary("/test.Echo/Unary")(b"ping")),
        "server_stream": await streamed(),
        "client_stream": await outcome(channel.stream_unary("/test.Echo/ClientStream")(iter([b"a", b"b"]))),
        "health": (await outcome(health_call)).status,
    }


def test_server_refuses_calls_without_the_secret_except_health():
    async def body():
        server = grpc.aio.server(interceptors=[ClusterSecretServerInterceptor(SECRET)])
        server.add_generic_rpc_handlers((GENERIC,))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        address = f"127.0.0.1:{port}"
        outcomes = {}
        for name, secret in (("right", SECRET), ("none", None), ("wrong", "guess")):
            async with grpc.aio.insecure_channel(address, interceptors=client_interceptors(secret) or None) as channel:
                outcomes[name] = await _calls(channel)
        await server.stop(None)
        return outcomes

    outcomes = asyncio.run(body())
    serving = health_pb2.HealthCheckResponse.SERVING
    assert outcomes["right"] == {
        "unary": b"ping",
        "server_stream": [b"x", b"x"],
        "client_stream": b"ab",
        "health": serving,
    }
    refused = grpc.StatusCode.UNAUTHENTICATED
    for name in ("none", "wrong"):
        assert outcomes[name] == {
            "unary": refused,
            "server_stream": refused,
            "client_stream": refused,
            "health": serving,
        }


def test_no_secret_adds_no_interceptor():
    assert client_interceptors(None) == [] and client_interceptors("") == []
    assert call_metadata(None) == () and call_metadata("") == ()


def test_the_secret_given_per_call_passes_as_the_interceptor_does():
    """The gateway's token streams carry the secret as call metadata, on a channel without interceptors."""

    async def body():
        server = grpc.aio.server(interceptors=[ClusterSecretServerInterceptor(SECRET)])
        server.add_generic_rpc_handlers((GENERIC,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        outcomes = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = channel.unary_stream("/test.Echo/ServerStream")
            for name, secret in (("right", SECRET), ("none", None), ("wrong", "guess")):
                try:
                    outcomes[name] = [item async for item in stream(b"x", metadata=call_metadata(secret))]
                except grpc.aio.AioRpcError as error:
                    outcomes[name] = error.code()
        await server.stop(None)
        return outcomes

    assert asyncio.run(body()) == {
        "right": [b"x", b"x"],
        "none": grpc.StatusCode.UNAUTHENTICATED,
        "wrong": grpc.StatusCode.UNAUTHENTICATED,
    }
