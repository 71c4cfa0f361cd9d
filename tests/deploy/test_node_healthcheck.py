"""deploy/node_healthcheck.py, the node containers' healthcheck, against real gRPC health servers on
127.0.0.1: plaintext, and TLS-only with mutual TLS (the node's own certificates, as compose hands
them through PDSERVE_NODE_GRPC_TLS_*)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.tls import GrpcTlsOptions
from tests.deploy.compose_files import REPO_ROOT
from tests.factories import build_test_certificates

CHECK = REPO_ROOT / "deploy" / "node_healthcheck.py"


@pytest.fixture
def serve_health():
    servers = []

    def serve(status, tls: GrpcTlsOptions | None = None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = health.HealthServicer()
        servicer.set("", status)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        credentials = tls.server_credentials() if tls else None
        port = (
            server.add_secure_port("127.0.0.1:0", credentials)
            if credentials
            else server.add_insecure_port("127.0.0.1:0")
        )
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        server.stop(None)


def run_check(address: str, **env: str) -> int:
    # Run as the image runs it: a script whose own folder comes first on sys.path (a file named
    # grpc_health.py there once shadowed the grpc_health package and failed every check).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_NODE_")}
    env = {**clean, "PYTHONPATH": str(REPO_ROOT), **env}
    return subprocess.run([sys.executable, str(CHECK), address], env=env, capture_output=True, timeout=30).returncode


def test_a_serving_node_is_healthy_and_a_not_serving_one_is_not(serve_health):
    assert run_check(serve_health(health_pb2.HealthCheckResponse.SERVING)) == 0
    assert run_check(serve_health(health_pb2.HealthCheckResponse.NOT_SERVING)) == 1


def test_a_tls_only_node_is_checked_over_mutual_tls_with_its_own_certificates(serve_health, tmp_path):
    paths = build_test_certificates(tmp_path)
    tls = GrpcTlsOptions(grpc_tls_cert=paths["cert"], grpc_tls_key=paths["key"], grpc_tls_ca=paths["ca"])
    address = serve_health(health_pb2.HealthCheckResponse.SERVING, tls)
    node_env = {
        "PDSERVE_NODE_GRPC_TLS_CERT": paths["cert"],
        "PDSERVE_NODE_GRPC_TLS_KEY": paths["key"],
        "PDSERVE_NODE_GRPC_TLS_CA": paths["ca"],
        "PDSERVE_NODE_ADVERTISE_HOST": "localhost",  # a name the certificate carries
    }
    assert run_check(address, **node_env) == 0
    assert run_check(address) == 1  # plaintext against a TLS-only node fails
    assert run_check(address, **{**node_env, "PDSERVE_NODE_ADVERTISE_HOST": "node-7.example"}) == 1  # wrong name
