"""Container healthcheck of a node: exits 0 when its standard gRPC health service says SERVING.

    python node_healthcheck.py [HOST:PORT]    (default: 127.0.0.1:$PDSERVE_NODE_PORT, else 50051)

The health service needs no cluster secret (pdserve/cluster_state/secret.py). With gRPC TLS (the
node's PDSERVE_NODE_GRPC_TLS_* variables set), the check dials TLS with the node's own certificates
and checks the server's certificate under the node's advertised name, as the gateway would. It
imports no torch: it runs every few seconds."""

import os
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tls import GrpcTlsOptions


def node_tls() -> GrpcTlsOptions:
    variables = {"grpc_tls_cert": "CERT", "grpc_tls_key": "KEY", "grpc_tls_ca": "CA"}
    return GrpcTlsOptions(
        **{field: os.environ.get(f"PDSERVE_NODE_GRPC_TLS_{name}") for field, name in variables.items()}
    )


def advertised_name() -> str:
    """The name the node's certificate must carry: --advertise-host, else the container's address."""
    host = os.environ.get("PDSERVE_NODE_ADVERTISE_HOST", "auto")
    return socket.gethostbyname(socket.gethostname()) if host in ("", "auto") else host


def open_health_channel(address: str, tls: GrpcTlsOptions) -> grpc.Channel:
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", advertised_name())])


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else f"127.0.0.1:{os.environ.get('PDSERVE_NODE_PORT', '50051')}"
    with open_health_channel(address, node_tls()) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return 1
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
