"""A node's Prometheus metrics, served on its own HTTP port (`--metrics-port`) at `/metrics`.

Names are vLLM's where they mean the same, with the `pdserve:` prefix, and every series carries
`role` and `node_id` labels (where vLLM has `model_name`). The engine knows nothing of
Prometheus: it stamps each output with its request's timestamps and counts plain ints; this
module turns them into metrics.

Lifecycle:
  1. `NodeMetrics(role, ...)` before the engine loop starts: `observe` is the AsyncEngine's output
     observer, so the latency histograms see every output on the engine thread;
  2. `start(node_id, host, port)` once the node has a name, before it registers: the HTTP server
     starts on its own thread; gauges and counters are read from the engine at scrape time;
  3. `stop()` shuts the HTTP server down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtransfer.base import KvTransferStats
from pdserve.engine.llm_engine import EngineCounters
from pdserve.engine.request import RequestOutput
from pdserve.engine.scheduler import EngineLoad

logger = logging.getLogger(__name__)

LABELS = ("role", "node_id")
# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
MAX_TRACKED_REQUESTS = 10_000  # an aborted request publishes no last output: forget the oldest past this


class NodeMetrics:
    """Owns the node's CollectorRegistry. `observe` runs on the engine thread; the collector reads
    the engine's load and counters and the KV transfer stats on the HTTP server's thread."""

    def __init__(
        self,
        role: str,
        num_blocks: int,
        load: Callable[[], EngineLoad],
        counters: Callable[[], EngineCounters],
        transfer_stats: Callable[[], KvTransferStats],
    ) -> None:
        self.role = role
        # A prefill node's only token is the first; a decode node streams from the second on.
        self.observes_first_token = role in ("prefill", "colocated")
        self.observes_request_end = role in ("decode", "colocated")
        self.registry = CollectorRegistry()
        self._collector = _EngineCollector(role, num_blocks, load, counters, transfer_stats)
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds", "added to the engine -> first token", LABELS,
            registry=self.registry, buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds", "between two tokens of a request", LABELS,
            registry=self.registry, buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds", "added to the engine -> last token", LABELS,
            registry=self.registry, buckets=REQUEST_BUCKETS,
        )  # fmt: skip
        self.queue_time = Histogram(
            "pdserve:request_queue_time_seconds", "added to the engine -> first scheduled", LABELS,
            registry=self.registry, buckets=REQUEST_BUCKETS,
        )  # fmt: skip
        self._labels: tuple[str, str] | None = None
        self._last_token_time: dict[str, float] = {}
        self._server = None
        self.address = ""  # host:port of /metrics once started

    def start(self, node_id: str, host: str, port: int, advertise_host: str | None = None) -> None:
        """Names the node in every series and serves /metrics (port 0: a free one)."""
        self._labels = (self.role, node_id)
        self._collector.labels = [self.role, node_id]
        for histogram in (self.ttft, self.itl, self.e2e, self.queue_time):
            histogram.labels(*self._labels)  # every series exists from the start, at 0
        self.registry.register(self._collector)
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.address = f"{advertise_host or host}:{self._server.server_address[1]}"
        logger.info("metrics on http://%s/metrics", self.address)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe(self, outputs: list[RequestOutput]) -> None:
        """The latency histograms from one batch of outputs (on the engine thread)."""
        if self._labels is None:
            return  # not started: no node name yet, and no request reached it
        now = time.monotonic()
        for output in outputs:
            if output.new_token_ids:
                self._observe_token(output, now)

    def _observe_token(self, output: RequestOutput, now: float) -> None:
        labels = self._labels
        last = self._last_token_time.pop(output.request_id, None)
        if last is not None:
            self.itl.labels(*labels).observe(now - last)
        elif self.observes_first_token:
            self.ttft.labels(*labels).observe(now - output.arrival_time)
            if output.first_scheduled_time is not None:
                self.queue_time.labels(*labels).observe(output.first_scheduled_time - output.arrival_time)
        if output.finished:
            if self.observes_request_end:
                self.e2e.labels(*labels).observe(now - output.arrival_time)
            return
        self._last_token_time[output.request_id] = now
        if len(self._last_token_time) > MAX_TRACKED_REQUESTS:
            del self._last_token_time[next(iter(self._last_token_time))]


class _EngineCollector(Collector):
    """Gauges and counters read at scrape time from plain ints the engine and KV transfer keep."""

    def __init__(self, role, num_blocks, load, counters, transfer_stats) -> None:
        self.labels = [role, ""]
        self.num_blocks = num_blocks
        self.load = load
        self.counters = counters
        self.transfer_stats = transfer_stats

    def collect(self) -> Iterator[Metric]:
        load, counters, transfer = self.load(), self.counters(), self.transfer_stats()
        usage = 1.0 - load.num_free_blocks / self.num_blocks if self.num_blocks else 0.0
        yield self._gauge("pdserve:num_requests_running", "requests in the running batch", load.num_running)
        yield self._gauge("pdserve:num_requests_waiting", "requests waiting to be scheduled", load.num_waiting_requests)
        yield self._gauge("pdserve:kv_cache_usage_perc", "KV cache usage: 1 means full", usage)
        yield self._counter("pdserve:prefix_cache_queries", "prompt tokens looked up", counters.num_prefix_query_tokens)
        yield self._counter("pdserve:prefix_cache_hits", "prompt tokens found cached", counters.num_prefix_hit_tokens)
        yield self._counter("pdserve:num_preemptions", "requests preempted", counters.num_preemptions)
        yield self._counter("pdserve:kv_transfer_received_bytes", "page bytes received", transfer.num_bytes_received)
        yield self._counter("pdserve:kv_transfer_received_blocks", "blocks committed", transfer.num_blocks_received)
        yield self._counter("pdserve:kv_transfer_commits", "transfers committed here", transfer.num_commits_received)
        yield self._counter("pdserve:kv_transfer_pushes", "pushes ended", transfer.num_pushes)
        yield self._counter("pdserve:kv_transfer_push_failures", "pushes failed", transfer.num_push_failures)
        yield self._counter("pdserve:kv_transfer_push_seconds", "last layer -> commit answered", transfer.push_seconds)

    def _gauge(self, name: str, documentation: str, value: float) -> Metric:
        metric = GaugeMetricFamily(name, documentation, labels=LABELS)
        metric.add_metric(self.labels, value)
        return metric

    def _counter(self, name: str, documentation: str, value: float) -> Metric:
        metric = CounterMetricFamily(name, documentation, labels=LABELS)
        metric.add_metric(self.labels, value)
        return metric
