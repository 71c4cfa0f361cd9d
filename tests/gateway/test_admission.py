"""Admission control: bounded work per phase, 429 with Retry-After past it, and counts that
return to zero on every path (done, error, closed early)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from gateway import app as gateway_app
from gateway.admission import AdmissionControl, OverloadedError
from gateway.app import create_app
from gateway.backend import BackendError, BackendErrorKind, GenerationChunk
from gateway.settings import AdmissionOptions
from pdserve.engine.sampling_params import SamplingParams
from tests.gateway.fakes import FakeBackend

PARAMS = SamplingParams(max_tokens=4)
CHUNKS = [GenerationChunk([5]), GenerationChunk([6]), GenerationChunk([2], finish_reason="stop")]
OPTIONS = AdmissionOptions(admission_prompt_tokens_per_prefill_node=100, admission_streams_per_decode_node=3)


def admission(num_nodes=None, **fake) -> AdmissionControl:
    backend = FakeBackend(CHUNKS, **fake)
    backend.num_nodes = num_nodes or {"prefill": 1, "decode": 1}
    return AdmissionControl(backend, OPTIONS)


def test_limits_scale_with_the_nodes_of_each_phase():
    assert admission({"prefill": 2, "decode": 3}).limits() == (200, 9)
    assert admission({"colocated": 2}).limits() == (200, 6)
    assert admission({}).limits() == (100, 3)  # no node seen yet: one node's worth


def test_prompt_tokens_count_until_the_first_token_and_streams_until_the_end():
    async def scenario():
        control = admission()
        stream = control.generate("r", [1] * 40, PARAMS)
        assert await anext(stream) == CHUNKS[0]
        assert (control.num_prompt_tokens, control.num_streams) == (0, 1)
        assert [chunk async for chunk in stream] == CHUNKS[1:]
        assert (control.num_prompt_tokens, control.num_streams) == (0, 0)

    asyncio.run(scenario())


def test_queued_prompt_tokens_past_the_limit_are_refused_with_a_retry_after():
    async def run():
        control = admission()
        gate = asyncio.Event()
        control.backend = GatedBackend(gate)
        a = control.generate("a", [1] * 60, PARAMS)
        b = control.generate("b", [1] * 50, PARAMS)
        first = asyncio.ensure_future(anext(a))
        await asyncio.sleep(0.01)
        assert control.num_prompt_tokens == 60
        with pytest.raises(OverloadedError) as refused:
            await anext(b)
        assert refused.value.kind is BackendErrorKind.OVERLOADED and refused.value.retry_after_s == 1
        assert "60 prompt tokens are waiting for prefill (limit 100)" in refused.value.message
        small = control.generate("c", [1] * 40, PARAMS)  # 60 + 40 fits
        second = asyncio.ensure_future(anext(small))
        await asyncio.sleep(0.01)
        assert control.num_prompt_tokens == 100
        gate.set()
        await first, await second
        assert control.num_prompt_tokens == 0 and control.num_streams == 2
        await a.aclose(), await small.aclose()
        assert control.num_streams == 0

    asyncio.run(run())


def test_an_oversized_prompt_goes_when_nothing_else_waits():
    async def run():
        control = admission()
        stream = control.generate("big", [1] * 500, PARAMS)
        assert await anext(stream) == CHUNKS[0]
        await stream.aclose()
        assert (control.num_prompt_tokens, control.num_streams) == (0, 0)

    asyncio.run(run())


def test_running_streams_past_the_limit_are_refused():
    async def run():
        control = admission()
        streams = [control.generate(f"r{i}", [1] * 10, PARAMS) for i in range(3)]
        for stream in streams:
            await anext(stream)
        with pytest.raises(OverloadedError, match="3 streams are running"):
            await anext(control.generate("r3", [1] * 10, PARAMS))
        await streams[0].aclose()  # a client gone frees its stream at once
        fourth = control.generate("r4", [1] * 10, PARAMS)
        assert await anext(fourth) == CHUNKS[0]
        for stream in [*streams[1:], fourth]:
            await stream.aclose()
        assert (control.num_prompt_tokens, control.num_streams) == (0, 0)

    asyncio.run(run())


def test_a_failed_generation_releases_what_it_held():
    async def run():
        control = admission(error=BackendError(BackendErrorKind.UNAVAILABLE, "node gone"), error_after=0)
        with pytest.raises(BackendError, match="node gone"):
            await anext(control.generate("r", [1] * 30, PARAMS))
        assert (control.num_prompt_tokens, control.num_streams) == (0, 0)

    asyncio.run(run())


class GatedBackend:
    """Answers each generation's chunks only once `gate` is set (prompts waiting for prefill)."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    def num_nodes_by_role(self) -> dict[str, int]:
        return {"prefill": 1, "decode": 1}

    async def generate(self, request_id, prompt_token_ids, params):
        await self.gate.wait()
        for chunk in CHUNKS:
            yield chunk


@pytest.fixture
def full_app(settings, served_model, monkeypatch):
    """The app over admission control whose only decode stream is already taken."""
    monkeypatch.setattr(gateway_app, "load_served_model", lambda _settings: served_model)
    backend = FakeBackend(CHUNKS)
    backend.num_nodes = {"colocated": 1}
    control = AdmissionControl(
        backend, AdmissionOptions(admission_streams_per_decode_node=1, admission_retry_after_s=7)
    )
    control.num_streams = 1  # as if one stream were running
    with TestClient(create_app(settings, control), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_past_the_limit_the_client_gets_429_with_retry_after_and_an_openai_error(full_app, stream):
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 4, "stream": stream}
    response = full_app.post("/v1/completions", json=body)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    assert "1 streams are running (limit 1)" in error["message"]


def test_a_full_node_is_a_429_with_retry_after_too(client, backend):
    backend.error = BackendError(BackendErrorKind.OVERLOADED, "decode node has no free KV blocks")
    response = client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
