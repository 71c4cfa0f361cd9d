"""Serving under node failures: a random node is killed every few seconds while load runs.

One cluster (embedded Redis, --prefill prefill nodes, --decode decode nodes, the gateway) on this
machine. Two levels of the same closed-loop load, one after the other:

    calm    no faults: the reference
    chaos   every --kill-every-s seconds one node, picked at random (seeded) among those up,
            gets SIGKILL; --down-s later it is started again under the same name

and for each: requests completed and failed, the requests the gateway migrated to another node
mid-stream (`pdserve_gateway_migrations_total`, where the gateway counts them), TTFT and
end-to-end latency, and the longest pause inside a stream (the largest inter-token gap): in the
chaos level that pause is what a failover adds to the streams it moves.

    pdserve bench chaos [--prefill 2] [--decode 2] [--duration-s 60] [--kill-every-s 10] [--down-s 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve import event_loop
from pdserve.bench.client import ClientConfig
from pdserve.bench.results import LevelResult, Load
from pdserve.bench.serving import run_benchmark
from pdserve.bench.workloads import WorkloadConfig, iter_conversations
from pdserve.options import add_model_flag

logger = logging.getLogger(__name__)

MIGRATIONS = "pdserve_gateway_migrations_total"


@dataclass(frozen=True)
class Kill:
    at_s: float  # since the chaos level started
    node: str
    restarted: bool


@dataclass(frozen=True)
class ChaosLevel:
    name: str
    level: LevelResult
    num_migrated: float
    kills: tuple[Kill, ...] = ()

    @property
    def longest_pause_ms(self) -> float:
        gaps = [gap for record in self.level.records if record.succeeded for gap in record.itls_s]
        return 1000 * max(gaps, default=0.0)


class NodeKiller:
    """Kills a random live node every `every_s` and starts it again `down_s` later, on its own
    thread, until stopped. Mutates the cluster only through the launcher's public calls."""

    def __init__(self, cluster, node_roles: dict[str, str], every_s: float, down_s: float, seed: int) -> None:
        self.cluster, self.node_roles, self.every_s, self.down_s = cluster, node_roles, every_s, down_s
        self.rng = random.Random(seed)
        self.kills: list[Kill] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-killer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> tuple[Kill, ...]:
        self._stop.set()
        self._thread.join()
        return tuple(self.kills)

    def _run(self) -> None:
        elapsed_s = 0.0
        while not self._stop.wait(self.every_s):
            elapsed_s += self.every_s
            node = self.rng.choice(sorted(self.node_roles))
            logger.info("chaos: SIGKILL %s", node)
            self.cluster.send_signal(node, signal.SIGKILL)
            self._stop.wait(self.down_s)
            self.kills.append(Kill(round(elapsed_s, 1), node, self._restart(node)))
            elapsed_s += self.down_s

    def _restart(self, node: str) -> bool:
        self.cluster.child(node).process.wait()
        try:
            self.cluster.start_node(self.node_roles[node], node, timeout_s=120)
        except Exception as error:  # reported; the bench goes on with one node fewer
            logger.warning("chaos: could not restart %s: %s", node, error)
            return False
        logger.info("chaos: %s is back", node)
        return True


def migrations(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10, follow_redirects=True).text
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return sum(sample.value for sample in samples if sample.name == MIGRATIONS)


def run_level(name: str, cluster, args: argparse.Namespace, killer: NodeKiller | None = None) -> ChaosLevel:
    workload = WorkloadConfig(input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    client_config = ClientConfig(base_url=cluster.base_url, timeout_s=args.timeout_s)
    load = Load(concurrency=args.concurrency, duration_s=args.duration_s)
    before = migrations(cluster.base_url)
    if killer is not None:
        killer.start()
    try:
        _, (level,) = event_loop.run(
            run_benchmark(client_config, [load], lambda tag: iter_conversations(workload, name), num_warmup=1)
        )
    finally:
        kills = killer.stop() if killer is not None else ()
    return ChaosLevel(name, level, migrations(cluster.base_url) - before, kills)


def run_chaos(args: argparse.Namespace) -> list[ChaosLevel]:
    from pdserve.cluster_state.embedded_redis import free_port
    from pdserve.launcher import Launcher, LaunchPlan

    plan = LaunchPlan(model=args.model, port=free_port(), num_prefill=args.prefill, num_decode=args.decode)
    with Launcher(plan) as cluster:
        node_roles = {spec.name: spec.role for spec in cluster.child_specs() if spec.is_node}
        calm = run_level("calm", cluster, args)
        killer = NodeKiller(cluster, node_roles, args.kill_every_s, args.down_s, args.seed)
        chaos = run_level("chaos", cluster, args, killer)
    return [calm, chaos]


def format_markdown(levels: Sequence[ChaosLevel]) -> str:
    lines = [
        "| level | requests ok | failed | migrated | TTFT p50 (ms) | E2E p50 (ms) | E2E p99 (ms) "
        "| longest pause (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        m = level.level.metrics
        ttft, e2e = m.ttft, m.e2e
        cells = [level.name, str(m.num_succeeded), str(m.num_failed), f"{level.num_migrated:.0f}"]
        cells += [f"{ttft.p50:.0f}" if ttft else "-", f"{e2e.p50:.0f}" if e2e else "-"]
        cells += [f"{e2e.p99:.0f}" if e2e else "-", f"{level.longest_pause_ms:.0f}"]
        lines.append(f"| {' | '.join(cells)} |")
    for level in levels:
        for error in level.level.metrics.errors:
            lines.append(f"- {level.name} error: {error}")
        for kill in level.kills:
            back = "restarted" if kill.restarted else "not restarted"
            lines.append(f"- {level.name}, {kill.at_s:.0f} s: SIGKILL {kill.node}, {back}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__.splitlines()[0])
    add_model_flag(parser)
    parser.add_argument("--prefill", type=int, default=2, help="prefill nodes")
    parser.add_argument("--decode", type=int, default=2, help="decode nodes")
    parser.add_argument("--duration-s", type=float, default=60.0, help="each level's length")
    parser.add_argument("--kill-every-s", type=float, default=10.0)
    parser.add_argument("--down-s", type=float, default=3.0, help="how long a killed node stays down")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    levels = run_chaos(args)
    print(format_markdown(levels))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"name": lv.name, "metrics": asdict(lv.level.metrics), "kills": [asdict(k) for k in lv.kills]}
                       for lv in levels], f, indent=2)  # fmt: skip
