from __future__ import annotations

from pdserve.bench.transfer import format_result, run


def test_transfer_benchmark_moves_real_pages_through_both_transports():
    result = run(prompt_tokens=64, repeats=1, pause_s=0.001)
    assert result["bytes"] == 30 * 2 * 4 * 16 * 3 * 64 * 4
    assert result["memcpy"] > 0 and result["hot_memcpy"] > 0 and result["grpc"] > 0 and result["shm"] > 0
    table = format_result(result, 64, 0.001)
    assert "shared memory" in table and "gRPC stream" in table
