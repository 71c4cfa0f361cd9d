"""The cluster secret through real processes (issue 12): a cluster whose gateway and nodes share a
secret serves; a local process without it gets UNAUTHENTICATED from every node RPC (the standard
health service excepted); and a decode node written into Redis without a valid signature is never
routed to, while real requests succeed."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster_state.registry import KEY_PREFIX, NodeCapacity, NodeInfo
from pdserve.cluster_state.secret import sign_entry
from pdserve.engine.scheduler import EngineLoad
from pdserve.launcher import Launcher
from protos import decode_pb2
from protos.token_stream import TokenStreamCall
from tests.e2e.helpers import e2e_plan, gateway_num_nodes, wait_until
from tests.factories import build_tiny_chat_model
from tests.faults.helpers import node_infos

pytestmark = pytest.mark.timeout(300)

SECRET = "test-cluster-secret-4f1c"
NODE_RPCS = {
    "decode": [("/pdserve.v1.DecodeService/Generate", "unary_stream")]
    + [(f"/pdserve.v1.KvTransferService/{name}", "unary_unary") for name in ("CommitKv", "RenewLeases")]
    + [("/pdserve.v1.KvTransferService/PushKv", "stream_unary")],
    "prefill": [("/pdserve.v1.PrefillService/Prefill", "unary_unary")],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    plan = e2e_plan(
        model,
        tmp_path_factory.mktemp("logs"),
        node_env=(("PDSERVE_NODE_CLUSTER_SECRET", SECRET),),
        gateway_env=(("PDSERVE_GATEWAY_CLUSTER_SECRET", SECRET),),
    )
    with Launcher(plan) as running:
        yield running


def completions(base_url: str, num_requests: int) -> list[httpx.Response]:
    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            bodies = [
                {"model": model, "prompt": f"User {i} asks about the sea.", "max_tokens": 8, "temperature": 0}
                for i in range(num_requests)
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))

    return asyncio.run(send_all())


def call_code(channel: grpc.Channel, method: str, kind: str) -> grpc.StatusCode:
    """Calls `method` with an empty message; the status it ends with."""
    try:
        if kind == "unary_stream":
            list(channel.unary_stream(method)(b"", timeout=10))
        elif kind == "stream_unary":
            channel.stream_unary(method)(iter([b""]), timeout=10)
        else:
            channel.unary_unary(method)(b"", timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_cluster_with_a_secret_serves(cluster):
    responses = completions(cluster.base_url, 2)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    client = redis.Redis.from_url(cluster.redis_url)
    entries = [json.loads(client.get(key) or "{}") for key in client.scan_iter(f"{KEY_PREFIX}*")]
    assert len(entries) == 2 and all("signature" in entry for entry in entries)  # every node signs its entry


def test_node_rpcs_without_the_secret_are_unauthenticated(cluster):
    nodes = node_infos(cluster.redis_url)
    assert {info.role for info in nodes.values()} == {"prefill", "decode"}
    for info in nodes.values():
        with grpc.insecure_channel(info.address) as channel:
            for method, kind in NODE_RPCS[info.role]:
                assert call_code(channel, method, kind) == grpc.StatusCode.UNAUTHENTICATED, (info.node_id, method)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health checks stay open
        wrong = [("authorization", "Bearer not-the-secret")]
        with grpc.insecure_channel(info.address) as channel:
            method = NODE_RPCS[info.role][0][0]
            try:
                channel.unary_unary(method)(b"", timeout=10, metadata=wrong)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                raise AssertionError(f"{method} on {info.node_id} accepted a wrong secret")
    decode = next(info for info in nodes.values() if info.role == "decode")
    for metadata in ((), wrong):  # the token stream, where the gateway reads Generate, checks it too
        call = TokenStreamCall(decode.token_stream_address, decode_pb2.GenerateRequest(request_id="x"), metadata)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(call.read())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # With the secret the same kind of call gets through to the servicer (an empty renewal is harmless).
    with grpc.insecure_channel(decode.address) as channel:
        renew = channel.unary_unary("/pdserve.v1.KvTransferService/RenewLeases")
        renew(b"", timeout=10, metadata=[("authorization", f"Bearer {SECRET}")])


class RecordingHandler(grpc.GenericRpcHandler):
    """A fake decode node: records every method it is called with and fails the call."""

    def __init__(self) -> None:
        self.methods: list[str] = []
        self.lock = threading.Lock()

    def service(self, handler_call_details):
        with self.lock:
            self.methods.append(handler_call_details.method)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake node")

        return grpc.unary_unary_rpc_method_handler(refuse)


def fake_decode_entry(node_id: str, port: int) -> dict:
    """A very attractive decode node: all blocks free, nothing running."""
    capacity = NodeCapacity(num_blocks=100_000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
    info = NodeInfo(
        node_id=node_id,
        role="decode",
        address=f"127.0.0.1:{port}",
        model="tiny",
        capacity=capacity,
        load=EngineLoad(num_free_blocks=100_000),
    )
    return info.model_dump(mode="json")


def test_forged_registry_entries_are_never_routed_to(cluster):
    nodes = node_infos(cluster.redis_url)
    real_decode = next(info for info in nodes.values() if info.role == "decode")
    recorder = RecordingHandler()
    fake_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    fake_server.add_generic_rpc_handlers((recorder,))
    port = fake_server.add_insecure_port("127.0.0.1:0")
    fake_server.start()
    client = redis.Redis.from_url(cluster.redis_url)
    unsigned = {**fake_decode_entry("decode-unsigned", port), "model": real_decode.model}
    wrongly_signed = sign_entry({**fake_decode_entry("decode-wrong-key", port), "model": real_decode.model}, "guess")
    try:
        # No TTL: the entries stay for the whole test, as an attacker's would if rewritten.
        client.set(f"{KEY_PREFIX}decode-unsigned", json.dumps(unsigned))
        client.set(f"{KEY_PREFIX}decode-wrong-key", json.dumps(wrongly_signed))
        wait_until(lambda: "does not verify" in cluster.log("gateway"), 10, "the gateway to ignore the forged entries")
        assert gateway_num_nodes(cluster.base_url).get("decode") == 1
        responses = completions(cluster.base_url, 6)
        assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
        assert recorder.methods == []  # not one prompt reached the fake node
        assert cluster.log("gateway").count("does not verify") == 2  # once per entry, not per refresh
    finally:
        client.delete(f"{KEY_PREFIX}decode-unsigned", f"{KEY_PREFIX}decode-wrong-key")
        fake_server.stop(None)
