"""A node whose container or host is gone answers no SYN: the gateway's channels (and a prefill
node's channels to decode nodes) give up connecting after about 2 s, not gRPC's default 20 s, so a
request routed to it while its registry entry lives fails over at once. Found by `docker kill` in
the compose check: one request took 22 s. Simulated on 127.0.0.1 with a listener whose accept
queue is full (the kernel then drops further SYNs)."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.node_health import CHANNEL_OPTIONS
from kvtransfer.grpc_transport import GRPC_OPTIONS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_address():
    """An address on 127.0.0.1 whose SYNs go unanswered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):  # never accepted: they fill the accept queue
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(listener.getsockname())
        fillers.append(filler)
    time.sleep(0.2)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    for sock in (*fillers, listener):
        sock.close()


def seconds_to_fail(address: str, options) -> float:
    started = time.monotonic()
    with grpc.insecure_channel(address, options=options) as channel, pytest.raises(grpc.RpcError) as raised:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    return time.monotonic() - started


@pytest.mark.parametrize("options", [CHANNEL_OPTIONS, GRPC_OPTIONS], ids=["gateway", "kv-transfer"])
def test_a_call_to_a_node_that_answers_no_syn_fails_within_seconds(silent_address, options):
    assert seconds_to_fail(silent_address, options) < 5
