"""Nodes trust only what they handed out (issue 12, second table), through real processes and
direct gRPC calls from a local process that is not the gateway. The cluster runs WITHOUT a
cluster secret, so what is tested is the nodes' own checks, not the secret:

1. a Generate asking for a huge deadline (deprecated kv_timeout_ms) that never gets pages is
   released after about one lease (UNAVAILABLE), and every block is free again;
2. a CommitKv claiming pages in shared memory that were never written is refused, and that
   Generate fails instead of decoding stale KV;
3. a Generate reusing a live request's id fails ALREADY_EXISTS and the live request completes
   with the right tokens;
4. a Prefill with a forged reservation token or an unregistered decode address fails
   FAILED_PRECONDITION and writes nothing;
5. afterwards the gateway gives the same greedy text as before the attacks, and every node
   reports no pending transfer and all blocks free."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import httpx
import pytest

from pdserve.cluster_state.registry import NodeInfo
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Launcher
from protos import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from protos.convert import sampling_params_to_proto
from tests.e2e.helpers import e2e_plan, wait_until
from tests.factories import build_tiny_chat_model
from tests.faults.helpers import is_idle, node_infos

pytestmark = pytest.mark.timeout(300)

CALL_TIMEOUT_S = 20
PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 and a partial one
PARAMS = sampling_params_to_proto(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
GATEWAY_PROMPT = "The lighthouse keeper counted the waves every night, and the sea never once told him the same story."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    # No secret anywhere: neither in the plan nor inherited from this process's environment.
    plan = e2e_plan(model, tmp_path_factory.mktemp("logs"), node_args=("--kv-lease-s", "1"))
    assert not plan.node_env and not plan.gateway_env
    with pytest.MonkeyPatch.context() as env:
        for name in ("PDSERVE_NODE_CLUSTER_SECRET", "PDSERVE_GATEWAY_CLUSTER_SECRET", "PDSERVE_UP_CLUSTER_SECRET"):
            env.delenv(name, raising=False)
        with Launcher(plan) as running:
            yield running


def infos_by_role(redis_url: str) -> dict[str, NodeInfo]:
    return {info.role: info for info in node_infos(redis_url).values()}


def completion_text(base_url: str) -> str:
    with httpx.Client(base_url=base_url, timeout=CALL_TIMEOUT_S) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": GATEWAY_PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def rpc_code(call, *args) -> grpc.StatusCode:
    """The status `call(*args)` ends with."""
    try:
        call(*args)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@contextlib.contextmanager
def lease_renewed(kv: kv_transfer_pb2_grpc.KvTransferServiceStub, token: str):
    """Keeps a reservation alive as its prefill node would (the lease is 1 s), while the test
    makes its hostile calls before the real Prefill."""
    stop, released = threading.Event(), []

    def renew():
        while not stop.wait(0.2):
            reply = kv.RenewLeases(kv_transfer_pb2.RenewLeasesRequest(request_ids=[token]), timeout=5)
            released.extend(reply.released_request_ids)

    kv.RenewLeases(kv_transfer_pb2.RenewLeasesRequest(request_ids=[token]), timeout=5)
    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
    assert not released, "the reservation was released while it was renewed"


def test_nodes_trust_only_what_they_handed_out(cluster):
    infos = infos_by_role(cluster.redis_url)
    decode_info, prefill_info = infos["decode"], infos["prefill"]
    decode_channel = grpc.insecure_channel(decode_info.address)
    prefill_channel = grpc.insecure_channel(prefill_info.address)
    decode = decode_pb2_grpc.DecodeServiceStub(decode_channel)
    kv = kv_transfer_pb2_grpc.KvTransferServiceStub(decode_channel)
    prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)

    def generate(rid: str, prompt: list[int] = PROMPT, **fields):
        request = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=PARAMS, **fields)
        return decode.Generate(request, timeout=CALL_TIMEOUT_S)

    def prefill_call(rid: str, token: str, decode_address: str = decode_info.address):
        request = prefill_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            sampling_params=PARAMS,
            decode_address=decode_address,
            reservation_token=token,
        )
        return prefill.Prefill(request, timeout=CALL_TIMEOUT_S)

    def finish(call, token: str, rid: str) -> list[int]:
        """The real prefill of a reserved request, then its decoded tokens."""
        first = prefill_call(rid, token)
        return [first.first_token_id] + [t for message in call for t in message.chunk.token_ids]

    def all_idle() -> bool:
        current = infos_by_role(cluster.redis_url)
        return len(current) == 2 and all(is_idle(info) for info in current.values())

    wait_until(all_idle, 10, "both nodes idle before the attacks")
    gateway_before = completion_text(cluster.base_url)
    baseline = generate("baseline")
    expected = finish(baseline, next(baseline).reserved.reservation_token, "baseline")
    assert len(expected) == 12

    # 1. A caller-picked deadline of 24.8 days: the node holds the blocks one lease, no more.
    call = generate("attack-deadline", list(range(2000, 2040)), kv_timeout_ms=2**31 - 1)
    assert next(call).reserved.num_blocks > 0
    started = time.monotonic()
    assert rpc_code(lambda: list(call)) == grpc.StatusCode.UNAVAILABLE
    assert 0.5 < time.monotonic() - started < 5  # about one lease (1 s)
    wait_until(lambda: is_idle(infos_by_role(cluster.redis_url)["decode"]), 10, "the decode node's blocks to be free")

    # 2. A commit claiming shared-memory pages that never came is refused; no stale KV is decoded.
    call = generate("attack-commit", list(range(3000, 3040)))
    token = next(call).reserved.reservation_token
    reservation = kv.GetReservation(kv_transfer_pb2.GetReservationRequest(reservation_token=token), timeout=5)
    assert reservation.shm_name.startswith("pdserve_kv_") and reservation.block_ids  # the shared-memory path
    commit = kv_transfer_pb2.KvCommit(request_id=token, first_token_id=5, pages_in_shared_memory=True)
    reply = kv.CommitKv(commit, timeout=5)
    assert not reply.ok and "commit after 0" in reply.error, reply
    assert rpc_code(lambda: list(call)) == grpc.StatusCode.UNAVAILABLE

    # 3 and 4. A live victim: its id reused, its token forged, an unregistered decode address.
    victim = generate("victim")
    token = next(victim).reserved.reservation_token
    with lease_renewed(kv, token):
        assert rpc_code(lambda: list(generate("victim"))) == grpc.StatusCode.ALREADY_EXISTS
        forgeries = [
            ("victim", decode_info.address),  # the victim's request id as the token
            ("0" * 32, decode_info.address),  # a guessed token
            (token, "127.0.0.1:1"),  # the right token, an address that is no node
            (token, prefill_info.address),  # a registered node, but not a decode node
        ]
        for forged_token, address in forgeries:
            code = rpc_code(prefill_call, "thief", forged_token, address)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (forged_token, address, code)
    assert finish(victim, token, "victim") == expected  # untouched: same tokens as the baseline

    # 5. The next user gets what users got before; nothing is left pending or held.
    assert completion_text(cluster.base_url) == gateway_before
    wait_until(all_idle, 10, "every node to report no pending transfer and all blocks free")
    decode_channel.close()
    prefill_channel.close()
