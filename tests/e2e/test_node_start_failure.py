"""A node that cannot serve (its port is taken) exits with a non-zero code and says why, so
the launcher, docker compose or systemd sees a failed start instead of a clean exit."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pdserve.cluster_state.embedded_redis import EmbeddedRedis
from tests.e2e.helpers import NODE_ARGS, REPO_ROOT
from tests.factories import build_tiny_chat_model

pytestmark = pytest.mark.timeout(180)


def test_a_node_whose_port_is_taken_exits_non_zero(tmp_path):
    model = str(build_tiny_chat_model(tmp_path / "tiny-chat"))
    with EmbeddedRedis() as redis_server, socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        argv = [sys.executable, "-m", "pdserve.cli", "colocated", "--model", model, "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--redis-url", redis_server.url, "--num-threads", "1", *NODE_ARGS]
        node = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
    assert node.returncode != 0
    assert f"Failed to bind to address 127.0.0.1:{port}" in node.stderr
    assert "RPC server failed" in node.stderr
