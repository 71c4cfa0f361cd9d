"""Serving metrics on synthetic timestamps whose TTFT, TPOT, ITL and E2E are known exactly."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from pdserve.bench.metrics import RequestRecord, Slo, compute_metrics

# Sent at 0, first content at 0.5 s, then a token every 0.1 s, [DONE] at 1.0 s; usage says 5 tokens.
STEADY = RequestRecord(0.0, 1.0, (0.5, 0.6, 0.7, 0.8, 0.9), num_output_tokens=5, num_prompt_tokens=10)
# Sent at 1.0, first content at 1.2, then every 0.2 s; 3 tokens.
SLOW = RequestRecord(1.0, 1.6, (1.2, 1.4, 1.6), num_output_tokens=3, num_prompt_tokens=20)
# A failure with timestamps that would distort every statistic if it were counted.
FAILED = RequestRecord(0.0, 50.0, (), num_output_tokens=None, error="HTTP 500: boom")


def test_one_request_has_exact_ttft_tpot_itl_e2e():
    assert STEADY.ttft_s == pytest.approx(0.5)
    assert STEADY.e2e_s == pytest.approx(1.0)
    assert STEADY.tpot_s == pytest.approx((1.0 - 0.5) / (5 - 1))
    assert STEADY.itls_s == pytest.approx([0.1] * 4)


def test_tpot_is_undefined_for_a_single_token():
    single = RequestRecord(0.0, 0.3, (0.3,), num_output_tokens=1)
    assert single.tpot_s is None and single.itls_s == []


def test_output_tokens_fall_back_to_the_number_of_content_chunks():
    without_usage = RequestRecord(0.0, 1.0, (0.5, 0.6, 0.7))
    assert without_usage.output_tokens == 3
    assert without_usage.tpot_s == pytest.approx(0.25)


def test_a_request_without_content_must_be_a_failure():
    with pytest.raises(ValueError, match="failed"):
        RequestRecord(0.0, 1.0, ())


def test_distributions_throughputs_and_failures():
    metrics = compute_metrics([STEADY, FAILED, SLOW], duration_s=2.0)
    assert (metrics.num_requests, metrics.num_succeeded, metrics.num_failed) == (3, 2, 1)
    assert metrics.errors == ("HTTP 500: boom",)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (30, 8)
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.output_throughput == pytest.approx(4.0)
    assert metrics.total_token_throughput == pytest.approx(19.0)
    assert metrics.goodput is None
    # TTFTs 500 and 200 ms; percentiles interpolate linearly, as numpy (and vLLM) do.
    assert astuple(metrics.ttft) == pytest.approx((2, 350.0, 350.0, 470.0, 497.0))
    assert astuple(metrics.tpot) == pytest.approx((2, 162.5, 162.5, 192.5, 199.25))
    assert astuple(metrics.e2e) == pytest.approx((2, 800.0, 800.0, 960.0, 996.0))
    # ITLs pooled over requests: four of 100 ms, two of 200 ms.
    assert astuple(metrics.itl) == pytest.approx((6, 400 / 3, 100.0, 200.0, 200.0))


def test_percentiles_over_many_values():
    records = [RequestRecord(0.0, 1.0, (ms / 1000,), num_output_tokens=1) for ms in range(1, 101)]
    ttft = compute_metrics(records, duration_s=1.0).ttft
    assert (ttft.count, ttft.mean, ttft.p50, ttft.p90, ttft.p99) == pytest.approx((100, 50.5, 50.5, 90.1, 99.01))


def test_goodput_counts_requests_meeting_every_slo():
    records = [STEADY, SLOW, FAILED]  # TTFT 500 / 200 ms, TPOT 125 / 200 ms
    assert compute_metrics(records, 2.0, Slo(ttft_ms=300)).goodput == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, Slo(tpot_ms=150)).goodput == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, Slo(ttft_ms=300, tpot_ms=150)).goodput == 0.0
    assert compute_metrics(records, 2.0, Slo(ttft_ms=500, tpot_ms=201)).goodput == pytest.approx(
        1.0
    )  # at most: 500 meets 500


def test_a_single_token_request_meets_any_tpot_slo():
    single = RequestRecord(0.0, 0.1, (0.1,), num_output_tokens=1)
    assert Slo(tpot_ms=1).is_met(single)
    assert not Slo(ttft_ms=50).is_met(single)


def test_all_failed_has_no_latencies_and_zero_throughput():
    metrics = compute_metrics([FAILED, FAILED], duration_s=5.0)
    assert metrics.num_failed == 2 and metrics.errors == ("HTTP 500: boom",)
    assert metrics.ttft is metrics.tpot is metrics.itl is metrics.e2e is None
    assert metrics.request_throughput == metrics.output_throughput == 0.0


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([STEADY], duration_s=0)
    with pytest.raises(ValueError, match="ttft_ms"):
        Slo(ttft_ms=-1)
