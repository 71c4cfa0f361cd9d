"""The load generator with a fake client: how many requests, how many in flight, in what order."""

from __future__ import annotations

import asyncio
import time
from itertools import islice

import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.results import Load
from pdserve.bench.serving import LoadGenerator, loads_from_args, parse_args
from pdserve.bench.workloads import WorkloadConfig, iter_conversations


class FakeClient:
    """Answers each request after `latency_s`; records what was sent and the peak in flight."""

    def __init__(self, latency_s: float = 0.01, fail_on_send: int | None = None):
        self.latency_s = latency_s
        self.fail_on_send = fail_on_send
        self.sent: list[list[dict]] = []
        self.send_times_s: list[float] = []
        self.in_flight = self.max_in_flight = 0

    async def send(self, messages, max_tokens):
        self.sent.append(messages)
        self.send_times_s.append(time.perf_counter())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start_s = time.perf_counter()
        await asyncio.sleep(self.latency_s)
        self.in_flight -= 1
        end_s = time.perf_counter()
        error = "HTTP 500: boom" if len(self.sent) == self.fail_on_send else None
        return RequestRecord(start_s, end_s, (end_s,), max_tokens, 1, error), f"reply {len(self.sent)}"


def run(client: FakeClient, load: Load, workload: WorkloadConfig | None = None, conversations=None):
    workload = workload or WorkloadConfig(input_len=4)
    conversations = conversations if conversations is not None else iter_conversations(workload, load.tag)
    generator = LoadGenerator(client, conversations, load, show_progress=False)
    return asyncio.run(generator.run())


def test_closed_loop_sends_num_requests_with_concurrency_in_flight():
    client = FakeClient()
    records, duration_s = run(client, Load(concurrency=3, num_requests=10))
    assert len(records) == len(client.sent) == 10
    assert client.max_in_flight == 3
    assert duration_s >= 4 * client.latency_s  # ceil(10 / 3) rounds


def test_multi_turn_conversations_run_turn_by_turn_and_carry_the_replies():
    client = FakeClient()
    workload = WorkloadConfig(kind="multi-turn", num_turns=3, input_len=4)
    records, _ = run(client, Load(concurrency=2, num_requests=6), workload)
    assert len(records) == 6
    assert sorted(len(messages) for messages in client.sent) == [1, 1, 3, 3, 5, 5]
    for messages in client.sent:
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert all(reply.startswith("reply ") for reply in replies)
    # Each conversation's next turn went out only after the previous one was answered.
    last_turns = [messages for messages in client.sent if len(messages) == 5]
    assert all(messages[1]["content"] != messages[3]["content"] for messages in last_turns)


def test_a_failed_turn_ends_its_conversation_but_is_counted():
    client = FakeClient(fail_on_send=1)
    workload = WorkloadConfig(kind="multi-turn", num_turns=3, input_len=4)
    records, _ = run(client, Load(concurrency=1, num_requests=4), workload)
    assert [record.succeeded for record in records] == [False, True, True, True]
    assert [len(messages) for messages in client.sent] == [1, 1, 3, 5]  # the second conversation ran in full


def test_the_budget_can_end_a_conversation_between_turns():
    client = FakeClient()
    workload = WorkloadConfig(kind="multi-turn", num_turns=3, input_len=4)
    run(client, Load(concurrency=1, num_requests=4), workload)
    assert [len(messages) for messages in client.sent] == [1, 3, 5, 1]


def test_poisson_arrivals_are_seeded_and_capped_by_concurrency():
    client = FakeClient(latency_s=0.05)
    records, _ = run(client, Load(concurrency=2, request_rate=200.0, num_requests=12))
    assert len(records) == 12 and client.max_in_flight <= 2
    again = FakeClient(latency_s=0.05)
    run(again, Load(concurrency=2, request_rate=200.0, num_requests=12))
    assert [m[0]["content"] for m in again.sent] == [m[0]["content"] for m in client.sent]


def test_poisson_arrivals_spread_over_time():
    client = FakeClient(latency_s=0.001)
    records, _ = run(client, Load(request_rate=50.0, num_requests=10))
    gaps = [b - a for a, b in zip(client.send_times_s, client.send_times_s[1:])]
    assert len(records) == 10 and client.max_in_flight <= 3
    assert 0.05 < sum(gaps) < 2.0  # 9 exponential gaps of mean 20 ms


def test_a_duration_stops_sending_and_waits_for_requests_in_flight():
    client = FakeClient(latency_s=0.05)
    records, duration_s = run(client, Load(concurrency=2, duration_s=0.3))
    assert 6 <= len(records) <= 14
    assert all(record.end_s - client.send_times_s[0] <= duration_s + 0.01 for record in records)
    assert max(client.send_times_s) - client.send_times_s[0] < 0.3


def test_a_finite_stream_ends_the_level_early():
    client = FakeClient()
    conversations = iter(list(islice(iter_conversations(WorkloadConfig(input_len=4)), 3)))
    records, _ = run(client, Load(concurrency=2, num_requests=10), conversations=conversations)
    assert len(records) == 3


def test_levels_from_the_command_line():
    sweep = loads_from_args(parse_args(["--concurrency", "1,8,32"]))
    assert [(load.concurrency, load.num_requests, load.tag) for load in sweep] == [
        (1, 100, "c1"),
        (8, 100, "c8"),
        (32, 100, "c32"),
    ]
    rates = loads_from_args(parse_args(["--request-rate", "0.5,2", "--concurrency", "4", "--duration-s", "30"]))
    assert [(load.request_rate, load.concurrency, load.num_requests, load.duration_s) for load in rates] == [
        (0.5, 4, None, 30.0),
        (2.0, 4, None, 30.0),
    ]
    assert loads_from_args(parse_args([]))[0].concurrency == 8
    with pytest.raises(ValueError, match="sweep either"):
        loads_from_args(parse_args(["--request-rate", "1", "--concurrency", "1,2"]))
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])


def test_a_load_must_end_by_itself():
    with pytest.raises(ValueError, match="num_requests or duration_s"):
        Load(concurrency=1)
    with pytest.raises(ValueError, match="concurrency, a request rate"):
        Load(num_requests=1)
