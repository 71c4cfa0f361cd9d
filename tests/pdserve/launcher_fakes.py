"""Fake children for the launcher's tests: tiny scripts that speak the per-component CLI
contract (a node that registers in Redis, a gateway whose /health counts the registered nodes).
tests/pdserve/conftest.py's `fakes` fixture runs them instead of `python -m pdserve.cli`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdserve.cluster_state.registry import RegistryView

REPO_ROOT = Path(__file__).resolve().parents[2]

# Parses the node flags of the contract (and prints any others), registers in Redis, leaves on SIGTERM.
FAKE_NODE = """
import argparse, asyncio, signal
from pdserve.cluster_state.registry import NodeCapacity, NodeInfo, NodeRegistration

parser = argparse.ArgumentParser()
parser.add_argument("role")
for flag in ("--model", "--host", "--port", "--redis-url", "--node-id", "--num-threads"):
    parser.add_argument(flag, required=True)
args, extra = parser.parse_known_args()
print(f"fake {args.role} {args.node_id} num_threads={args.num_threads} extra={' '.join(extra)}", flush=True)

async def main():
    capacity = NodeCapacity(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    address = f"{args.host}:{args.port}"
    info = NodeInfo(node_id=args.node_id, role=args.role, address=address, model=args.model, capacity=capacity)
    registration = NodeRegistration(args.redis_url, info, lambda: info.load, interval_s=0.2, ttl_s=1.0)
    await registration.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await registration.stop()

asyncio.run(main())
"""

# Parses the gateway flags; GET /health answers 200 with the nodes registered in Redis per role,
# or (with --blind) with none, like a gateway that has not seen them yet.
FAKE_GATEWAY = """
import argparse, collections, http.server, json, redis

parser = argparse.ArgumentParser()
parser.add_argument("role")
for flag in ("--model", "--host", "--port", "--redis-url"):
    parser.add_argument(flag, required=True)
parser.add_argument("--blind", action="store_true")
args = parser.parse_args()
client = redis.Redis.from_url(args.redis_url)

def num_nodes():
    keys = [] if args.blind else list(client.scan_iter("pdserve:node:*"))
    return collections.Counter(json.loads(value)["role"] for value in client.mget(keys) if value) if keys else {}

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "num_nodes": num_nodes()}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass

http.server.HTTPServer((args.host, int(args.port)), Health).serve_forever()
"""

CRASH = "import sys; print('boom: weights not found', flush=True); sys.exit(3)"
IGNORE_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring SIGTERM', flush=True); "
    "time.sleep(60)"
)


def registered_node_ids(redis_url: str) -> list[str]:
    async def read():
        view = RegistryView(redis_url)
        await view.refresh()
        await view.stop()
        return [info.node_id for info in view.nodes()]

    return asyncio.run(read())
