"""Optional TLS for internal gRPC (protos/tls.py) on a node's real gRPC server (pdserve/node.py
`_start_grpc`): with a CA, it answers only TLS clients that trust that CA and present a
certificate it signed; plaintext clients and clients of another CA are refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.base import KvTransferStats
from pdserve.node import _start_grpc
from pdserve.options import NodeSettings
from protos.tls import GrpcTlsOptions, open_channel
from tests.factories import build_test_certificates

pytestmark = pytest.mark.timeout(120)


class NoServicers:
    """A node service that adds nothing: the server keeps only its health service."""

    kv_storage = None
    layer_hook = None

    def add_to_server(self, server, async_engine) -> None:
        pass

    def kv_transfer_stats(self) -> KvTransferStats:
        return KvTransferStats()

    async def close(self) -> None:
        pass


def tls_options(paths: dict[str, str], with_cert: bool = True) -> GrpcTlsOptions:
    if not with_cert:
        return GrpcTlsOptions(grpc_tls_ca=paths["ca"])
    return GrpcTlsOptions(grpc_tls_cert=paths["cert"], grpc_tls_key=paths["key"], grpc_tls_ca=paths["ca"])


async def check(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """SERVING, or the status code the health check failed with."""
    async with open_channel(address, credentials) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def test_a_tls_node_answers_only_clients_of_its_ca(tmp_path):
    ours, theirs = build_test_certificates(tmp_path / "ours"), build_test_certificates(tmp_path / "theirs", "other-ca")
    settings = NodeSettings(
        host="127.0.0.1", grpc_tls_cert=ours["cert"], grpc_tls_key=ours["key"], grpc_tls_ca=ours["ca"]
    )

    async def body() -> dict[str, str]:
        server, _, port = await _start_grpc(settings, NoServicers(), None)
        address = f"127.0.0.1:{port}"
        try:
            clients = {
                "right ca": tls_options(ours).channel_credentials(),
                "plaintext": None,
                "other ca": tls_options(theirs).channel_credentials(),
                "no client cert": tls_options(ours, with_cert=False).channel_credentials(),
            }
            return {name: await check(address, credentials) for name, credentials in clients.items()}
        finally:
            await server.stop(None)

    outcomes = asyncio.run(body())
    assert outcomes == {
        "right ca": "SERVING",
        "plaintext": "UNAVAILABLE",
        "other ca": "UNAVAILABLE",
        "no client cert": "UNAVAILABLE",
    }


def test_no_paths_mean_plaintext():
    options = GrpcTlsOptions()
    assert not options.tls_enabled
    assert options.server_credentials() is None and options.channel_credentials() is None


def test_a_cert_needs_its_key():
    with pytest.raises(ValueError, match="together"):
        GrpcTlsOptions(grpc_tls_cert="cert.pem")


def test_a_node_needs_a_cert_to_serve_tls():
    with pytest.raises(ValueError, match="--grpc-tls-cert"):
        GrpcTlsOptions(grpc_tls_ca="ca.pem").server_credentials()
