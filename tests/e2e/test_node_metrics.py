"""Every node's Prometheus /metrics through real processes: embedded Redis, a prefill node, a
decode node and the gateway on a tiny model; a few chats, then each node's counters."""

from __future__ import annotations

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.tokenizer import Tokenizer
from pdserve.cluster_state.registry import NodeInfo, node_key
from pdserve.launcher import Launcher
from tests.e2e.helpers import e2e_plan, wait_until
from tests.factories import build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)

NUM_REQUESTS = 3
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Where is the shelf of maps in this library? " * 4}]


def node_metrics(redis_url: str, node_id: str) -> dict[str, float]:
    """The node's samples (name -> value, one series per name) from the /metrics its registry entry names."""
    info = NodeInfo.from_json(redis.Redis.from_url(redis_url).get(node_key(node_id)))
    assert info.metrics_address, f"{node_id} publishes no metrics address"
    text = httpx.get(f"http://{info.metrics_address}/metrics", timeout=5).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("node_id") == node_id and "le" not in sample.labels:
                samples[sample.name] = sample.value
    return samples


def test_every_node_serves_metrics_whose_counters_moved(tmp_path_factory):
    model = str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    tokenizer = Tokenizer.from_folder(model)
    num_prompt_tokens = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False))
    with Launcher(e2e_plan(model, tmp_path_factory.mktemp("logs"))) as cluster:
        for _ in range(NUM_REQUESTS):
            body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()

        def pushed() -> bool:  # counted once the decode node answered the commit: maybe after the response
            return node_metrics(cluster.redis_url, "prefill-0")["pdserve:kv_transfer_pushes_total"] == NUM_REQUESTS

        wait_until(pushed, 10, "the prefill node's pushes")
        prefill = node_metrics(cluster.redis_url, "prefill-0")
        decode = node_metrics(cluster.redis_url, "decode-0")

    assert prefill["pdserve:time_to_first_token_seconds_count"] == NUM_REQUESTS
    assert prefill["pdserve:request_queue_time_seconds_count"] == NUM_REQUESTS
    assert prefill["pdserve:e2e_request_latency_seconds_count"] == 0
    assert prefill["pdserve:prefix_cache_queries_total"] == NUM_REQUESTS * num_prompt_tokens
    assert prefill["pdserve:prefix_cache_hits_total"] > 0  # the same prompt again
    assert prefill["pdserve:kv_transfer_push_failures_total"] == 0
    assert prefill["pdserve:kv_transfer_push_seconds_total"] > 0

    assert decode["pdserve:e2e_request_latency_seconds_count"] == NUM_REQUESTS
    # The first token comes from the prefill node; the decode node streams the other 7, 6 gaps.
    assert decode["pdserve:inter_token_latency_seconds_count"] == NUM_REQUESTS * (MAX_TOKENS - 2)
    assert decode["pdserve:time_to_first_token_seconds_count"] == 0
    assert decode["pdserve:kv_transfer_commits_total"] == NUM_REQUESTS
    assert decode["pdserve:kv_transfer_received_blocks_total"] > 0
    assert decode["pdserve:prefix_cache_queries_total"] == NUM_REQUESTS * num_prompt_tokens
    assert decode["pdserve:num_requests_running"] == 0
    assert decode["pdserve:num_preemptions_total"] == 0
