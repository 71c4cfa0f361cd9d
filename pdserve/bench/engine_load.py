"""The engine alone under a serving load: `pdserve-engine` in `pdserve bench compare`.

The same closed loop the HTTP client runs (at most N requests in flight, the next sent as one
finishes), but submitted straight to an in-process `LLMEngine` with the nodes' engine flags. A
token's time is the end of the step that produced it, so TTFT, TPOT and ITL here are what the
engine itself takes, and the served rows beside them show what the gateway, gRPC and SSE add.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.results import LevelResult, Load
from pdserve.engine import LLMEngine, SamplingParams


def run_level(engine: LLMEngine, load: Load, prompts: Sequence[list[int]], output_len: int) -> LevelResult:
    """Runs every prompt, at most `load.concurrency` at a time; greedy, EOS ignored."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    waiting = deque(enumerate(prompts))
    started: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    records: list[RequestRecord] = []
    level_start = time.perf_counter()
    while waiting or started:
        while waiting and len(started) < load.concurrency:
            index, prompt = waiting.popleft()
            request_id = f"engine-load-{index}"
            engine.add_request(request_id, prompt, params)
            started[request_id], token_times[request_id] = time.perf_counter(), []
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            token_times[output.request_id] += [now] * len(output.new_token_ids)
            if output.finished:
                times = token_times.pop(output.request_id)
                start = started.pop(output.request_id)
                records.append(RequestRecord(start, now, tuple(times), len(times), output.num_prompt_tokens))
    return LevelResult(load, compute_metrics(records, time.perf_counter() - level_start), tuple(records))
