"""The chaos benchmark's node killer and report, over a fake cluster (no processes)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

import pytest

from pdserve.bench.chaos import ChaosLevel, Kill, NodeKiller, format_markdown
from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.results import LevelResult, Load


@dataclass
class FakeProcess:
    def wait(self) -> int:
        return -9


@dataclass
class FakeChild:
    process: FakeProcess = field(default_factory=FakeProcess)


@dataclass
class FakeCluster:
    """Records the launcher calls the killer makes; `start_node` of `failing` raises."""

    calls: list[tuple] = field(default_factory=list)
    failing: str = ""

    def send_signal(self, name: str, sig: int) -> None:
        self.calls.append(("signal", name, sig))

    def child(self, name: str) -> FakeChild:
        return FakeChild()

    def start_node(self, role: str, name: str, timeout_s: float) -> None:
        self.calls.append(("start", role, name))
        if name == self.failing:
            raise RuntimeError("exited while starting")


def test_the_killer_kills_a_seeded_random_node_and_starts_it_again_under_its_name():
    cluster = FakeCluster(failing="decode-1")
    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    killer = NodeKiller(cluster, roles, every_s=0.05, down_s=0.01, seed=3)
    killer.start()
    time.sleep(0.5)
    kills = killer.stop()
    assert len(kills) >= 3
    for kill, (signal_call, start_call) in zip(kills, zip(cluster.calls[::2], cluster.calls[1::2])):
        assert signal_call == ("signal", kill.node, signal.SIGKILL)
        assert start_call == ("start", roles[kill.node], kill.node)
        assert kill.restarted is (kill.node != "decode-1")
    again = NodeKiller(FakeCluster(), roles, every_s=0.05, down_s=0.01, seed=3)
    assert [again.rng.choice(sorted(roles)) for _ in kills] == [kill.node for kill in kills]


def test_the_report_counts_failures_migrations_and_the_longest_pause():
    ok = RequestRecord(start_s=0.0, end_s=1.0, content_times_s=(0.2, 0.3, 0.9), num_output_tokens=3)
    failed = RequestRecord(start_s=0.0, end_s=0.5, error="stream broke")
    level = LevelResult(Load(concurrency=2, num_requests=2), compute_metrics([ok, failed], 1.0), (ok, failed))
    chaos = ChaosLevel("chaos", level, num_migrated=4, kills=(Kill(10.0, "decode-0", True),))
    assert chaos.longest_pause_ms == pytest.approx(600)
    report = format_markdown([chaos])
    assert "| chaos | 1 | 1 | 4 | 200 | 1000 | 1000 | 600 |" in report
    assert "- chaos error: stream broke" in report
    assert "- chaos, 10 s: SIGKILL decode-0, restarted" in report
