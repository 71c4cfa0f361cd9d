"""TLS on internal gRPC through real processes (issue 12): a cluster whose gateway and nodes get
the same certificate and CA serves a chat completion, gateway -> prefill -> decode all over mutual
TLS, and a node's port (gRPC, and the decode node's token stream) refuses a plaintext client."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster_state.registry import KEY_PREFIX, NodeInfo
from pdserve.launcher import Launcher
from protos import decode_pb2
from protos.token_stream import TokenStreamCall
from tests.e2e.helpers import e2e_plan
from tests.factories import build_test_certificates, build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    paths = build_test_certificates(tmp_path_factory.mktemp("certs"))
    tls_flags = ("--grpc-tls-cert", paths["cert"], "--grpc-tls-key", paths["key"], "--grpc-tls-ca", paths["ca"])
    plan = e2e_plan(model, tmp_path_factory.mktemp("logs"), node_args=tls_flags, gateway_args=tls_flags)
    with Launcher(plan) as running:
        yield running


def test_a_tls_cluster_serves_a_chat_completion(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def test_a_tls_node_refuses_a_plaintext_client(cluster):
    client = redis.Redis.from_url(cluster.redis_url)
    addresses = [NodeInfo.from_json(client.get(key)).address for key in client.scan_iter(f"{KEY_PREFIX}*")]
    assert len(addresses) == 2
    for address in addresses:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_tls_decode_node_serves_its_token_stream_to_tls_clients_only(cluster):
    client = redis.Redis.from_url(cluster.redis_url)
    nodes = [NodeInfo.from_json(client.get(key)) for key in client.scan_iter(f"{KEY_PREFIX}*")]
    (decode,) = [node for node in nodes if node.role == "decode"]
    assert decode.token_stream_address  # the gateway read the chat completion's tokens from it
    call = TokenStreamCall(decode.token_stream_address, decode_pb2.GenerateRequest(request_id="plaintext"))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(call.read())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
