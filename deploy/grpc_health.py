"""Container healthcheck of a node: exits 0 when its standard gRPC health service says SERVING.

    python grpc_health.py [HOST:PORT]    (default: 127.0.0.1:$PDSERVE_NODE_PORT, else 50051)

The health service needs no cluster secret (pdserve/cluster_state/secret.py). With gRPC TLS, give
the check the same certificates or use a TCP check instead."""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else f"127.0.0.1:{os.environ.get('PDSERVE_NODE_PORT', '50051')}"
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return 1
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
