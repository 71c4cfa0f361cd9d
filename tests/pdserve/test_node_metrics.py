"""A node's metrics from a tiny engine: exact histogram counts per role, counters read at scrape time."""

from __future__ import annotations

import urllib.request

import pytest

from kvtransfer.base import KvTransferStats
from pdserve.engine import SamplingParams
from pdserve.engine.request import RequestOutput
from pdserve.node_metrics import NodeMetrics
from tests.pdserve.engine.test_llm_engine import make_engine, random_prompt


def node_metrics(role, engine, transfer: KvTransferStats | None = None) -> NodeMetrics:
    num_blocks = engine.kv_cache_manager.block_pool.num_blocks
    return NodeMetrics(role, num_blocks, engine.load, engine.counters, lambda: transfer or KvTransferStats())


@pytest.fixture
def started():
    metrics: list[NodeMetrics] = []

    def start(m: NodeMetrics) -> NodeMetrics:
        m.start("node-1", "127.0.0.1", 0)
        metrics.append(m)
        return m

    yield start
    for m in metrics:
        m.stop()


def value(metrics: NodeMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"role": metrics.role, "node_id": "node-1"})


def run(engine, metrics: NodeMetrics) -> None:
    while engine.has_unfinished_requests:
        metrics.observe(engine.step())


def test_colocated_node_counts_every_latency_preemptions_and_prefix_queries(tiny_llama_path, started):
    # 12 blocks of 16 tokens; four 40-token prompts growing to 60 tokens: the newest is preempted once.
    engine = make_engine(tiny_llama_path, num_blocks=12, prefix_caching=False)
    metrics = started(node_metrics("colocated", engine))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"p{i}", random_prompt(40, seed=10 + i), params)
    assert value(metrics, "pdserve:num_requests_waiting") == 4
    run(engine, metrics)

    assert value(metrics, "pdserve:time_to_first_token_seconds_count") == 4
    assert value(metrics, "pdserve:request_queue_time_seconds_count") == 4
    assert value(metrics, "pdserve:inter_token_latency_seconds_count") == 4 * 19
    assert value(metrics, "pdserve:e2e_request_latency_seconds_count") == 4
    assert value(metrics, "pdserve:num_preemptions_total") == 1
    assert value(metrics, "pdserve:prefix_cache_queries_total") == 4 * 40  # once per request, not on recompute
    assert value(metrics, "pdserve:prefix_cache_hits_total") == 0
    assert value(metrics, "pdserve:num_requests_running") == 0
    assert value(metrics, "pdserve:kv_cache_usage_perc") == 0.0
    with urllib.request.urlopen(f"http://{metrics.address}/metrics", timeout=5) as response:
        body = response.read().decode()
    assert 'pdserve:num_preemptions_total{node_id="node-1",role="colocated"} 1.0' in body


def test_prefill_node_counts_first_tokens_and_prefix_hits_but_no_request_end(tiny_llama_path, started):
    engine = make_engine(tiny_llama_path, num_blocks=24)
    metrics = started(node_metrics("prefill", engine))
    prompt = random_prompt(40, seed=1)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    run(engine, metrics)
    assert value(metrics, "pdserve:kv_cache_usage_perc") == pytest.approx(3 / 24)  # held for the push
    engine.add_request("b", prompt, SamplingParams(max_tokens=1))
    run(engine, metrics)

    assert value(metrics, "pdserve:time_to_first_token_seconds_count") == 2
    assert value(metrics, "pdserve:e2e_request_latency_seconds_count") == 0
    assert value(metrics, "pdserve:inter_token_latency_seconds_count") == 0
    assert value(metrics, "pdserve:prefix_cache_queries_total") == 80
    assert value(metrics, "pdserve:prefix_cache_hits_total") == 32  # b: a's two full blocks


def token(request_id: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [7], [], finished, "length" if finished else None, 4, 0, arrival_time=0.0)


def test_decode_node_counts_gaps_between_streamed_tokens_and_request_ends(tiny_llama_path, started):
    engine = make_engine(tiny_llama_path, num_blocks=24)
    metrics = started(node_metrics("decode", engine))
    metrics.observe([token("a"), token("b")])  # their first tokens came from a prefill node
    metrics.observe([token("a"), token("b", finished=True)])
    metrics.observe([token("a", finished=True)])

    assert value(metrics, "pdserve:time_to_first_token_seconds_count") == 0
    assert value(metrics, "pdserve:inter_token_latency_seconds_count") == 3
    assert value(metrics, "pdserve:e2e_request_latency_seconds_count") == 2


def test_kv_transfer_counters_come_from_the_nodes_stats(tiny_llama_path, started):
    engine = make_engine(tiny_llama_path, num_blocks=24)
    stats = KvTransferStats(
        num_blocks_received=6, num_bytes_received=4096, num_commits_received=2, num_pushes=3, num_push_failures=1,
        push_seconds=0.5,
    )  # fmt: skip
    metrics = started(node_metrics("decode", engine, stats))
    assert value(metrics, "pdserve:kv_transfer_received_bytes_total") == 4096
    assert value(metrics, "pdserve:kv_transfer_received_blocks_total") == 6
    assert value(metrics, "pdserve:kv_transfer_commits_total") == 2
    assert value(metrics, "pdserve:kv_transfer_pushes_total") == 3
    assert value(metrics, "pdserve:kv_transfer_push_failures_total") == 1
    assert value(metrics, "pdserve:kv_transfer_push_seconds_total") == 0.5
