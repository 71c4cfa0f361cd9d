"""ClusterBackend over scripted prefill and decode nodes (real gRPC servers in this process):
a failed call is blamed on the node that made it, and only that node is routed around; a
stream that breaks after tokens were sent resumes on other nodes with no gap or duplicate;
attempts and migrations are bounded; and every attempt releases its place in the router's
in-flight counts and its decode reservation. Every test runs with the decode nodes read over gRPC
and over their token streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.backend import BackendError, BackendErrorKind
from gateway.failover import MIGRATIONS, FailoverPolicy
from gateway.generation import ChoiceSpec, stream_choice
from pdserve.engine.sampling_params import SamplingParams
from tests.gateway import scripted_nodes
from tests.gateway.scripted_nodes import (
    PROMPT,
    SCRIPT,
    ScriptedDecode,
    ScriptedPrefill,
    assert_released,
    cluster,
    generate,
    tokens,
)


@pytest.fixture(autouse=True, params=scripted_nodes.TRANSPORTS)
def decode_transport(request, monkeypatch) -> str:
    monkeypatch.setattr(scripted_nodes, "DECODE_TRANSPORT", request.param)
    return request.param


@pytest.mark.parametrize("how", ["refuses", "dead"])
def test_a_failing_prefill_node_is_retried_on_another_with_the_same_decode_node(how):
    decode, good = ScriptedDecode(), ScriptedPrefill()
    bad = ScriptedPrefill(fail=grpc.StatusCode.UNAVAILABLE) if how == "refuses" else None

    async def main():
        async with cluster(p0=bad, p1=good, d0=decode) as backend:  # p0 first: same work, lower id
            chunks = await generate(backend)
            assert_released(backend)
            return chunks, backend.registry.nodes("decode")[0].address

    chunks, decode_address = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [[t] for t in SCRIPT[:3]]
    assert chunks[0].route.startswith("prefill=p1; decode=d0") and "migrations" not in chunks[0].route
    assert good.decode_addresses == [decode_address]
    if bad is not None:
        assert bad.decode_addresses == [decode_address]
    # The first attempt's reservation was cancelled (the decode node freed its blocks); the
    # second, under its own request id, finished.
    assert decode.ended == [("req", "cancelled"), ("req.1", "finished")]


def test_a_failing_decode_node_is_routed_around_and_the_prefill_node_stays_eligible():
    prefill, bad, good = ScriptedPrefill(), ScriptedDecode(fail=grpc.StatusCode.UNAVAILABLE), ScriptedDecode()

    async def main():
        async with cluster(p0=prefill, d0=bad, d1=good) as backend:  # d0 first: same load, lower id
            chunks = await generate(backend)
            assert_released(backend)
            return chunks, {n.node_id: n.address for n in backend.registry.nodes()}

    chunks, addresses = asyncio.run(main())
    assert chunks[0].route.startswith("prefill=p0; decode=d1")
    assert tokens(chunks) == SCRIPT[:3]
    assert prefill.decode_addresses == [addresses["d1"]]  # d0 failed before its prefill was called
    assert (bad.ended, good.ended) == ([("req", "failed")], [("req.1", "finished")])


def test_a_prefill_aborted_because_the_decode_node_released_it_blames_the_decode_node():
    # ABORTED from Prefill says the decode side let the reservation go (its lease ended): the
    # prefill node is healthy and stays eligible; the next attempt goes to the other decode node.
    prefill = ScriptedPrefill(fail=grpc.StatusCode.ABORTED, num_failures=1)
    first, second = ScriptedDecode(), ScriptedDecode()

    async def main():
        async with cluster(p0=prefill, d0=first, d1=second) as backend:
            chunks = await generate(backend)
            assert_released(backend)
            return chunks, {n.node_id: n.address for n in backend.registry.nodes()}

    chunks, addresses = asyncio.run(main())
    assert tokens(chunks) == SCRIPT[:3]
    assert chunks[0].route.startswith("prefill=p0; decode=d1")
    assert prefill.decode_addresses == [addresses["d0"], addresses["d1"]]
    assert (first.ended, second.ended) == ([("req", "cancelled")], [("req.1", "finished")])


def test_when_every_node_of_a_role_fails_they_are_tried_again_within_the_bound():
    failing = [ScriptedPrefill(fail=grpc.StatusCode.UNAVAILABLE) for _ in range(2)]
    decode = ScriptedDecode()

    async def main():
        async with cluster(p0=failing[0], p1=failing[1], d0=decode) as backend:
            with pytest.raises(BackendError) as raised:
                await generate(backend)
            assert_released(backend)
            return raised.value

    error = asyncio.run(main())
    assert error.kind == BackendErrorKind.UNAVAILABLE
    assert error.message == "prefill node p0: unavailable: prefill node going away"
    assert [len(p.requests) for p in failing] == [2, 1]  # p0, p1, then p0 again: three attempts
    assert decode.ended == [("req", "cancelled"), ("req.1", "cancelled"), ("req.2", "cancelled")]


def test_the_only_node_of_a_role_is_tried_again_after_a_passing_failure():
    """A prefill node that dropped one request (its decode side gave up, say) is not dead: with
    no other prefill node, the next attempt goes to it again."""
    flaky, decode = ScriptedPrefill(fail=grpc.StatusCode.ABORTED, num_failures=1), ScriptedDecode()

    async def main():
        async with cluster(p0=flaky, d0=decode) as backend:
            chunks = await generate(backend)
            assert_released(backend)
            return chunks

    assert tokens(asyncio.run(main())) == SCRIPT[:3]
    assert len(flaky.requests) == 2
    assert decode.ended == [("req", "cancelled"), ("req.1", "finished")]


def test_attempts_that_send_nothing_are_bounded():
    failing = [ScriptedPrefill(fail=grpc.StatusCode.UNAVAILABLE) for _ in range(3)]

    async def main():
        nodes = dict(p0=failing[0], p1=failing[1], p2=failing[2], d0=ScriptedDecode())
        async with cluster(FailoverPolicy(max_attempts=2), **nodes) as backend:
            with pytest.raises(BackendError, match="prefill node p1: unavailable"):
                await generate(backend)
            assert_released(backend)

    asyncio.run(main())
    assert [len(p.requests) for p in failing] == [1, 1, 0]


def test_a_refused_request_is_not_retried():
    prefill = ScriptedPrefill(fail=grpc.StatusCode.INVALID_ARGUMENT)
    other, decode = ScriptedPrefill(), ScriptedDecode()

    async def main():
        async with cluster(p0=prefill, p1=other, d0=decode) as backend:
            with pytest.raises(BackendError) as raised:
                await generate(backend)
            assert_released(backend)
            return raised.value

    assert asyncio.run(main()).kind == BackendErrorKind.INVALID_REQUEST
    assert other.requests == []
    assert decode.ended == [("req", "cancelled")]


@pytest.mark.parametrize("how", ["breaks", "ends early"])
def test_a_stream_that_breaks_after_tokens_were_sent_resumes_on_another_decode_node(how):
    """Two tokens reach the client (the prefill node's and one decoded), then d0 goes: d1
    continues from the third, asked for prompt + those two tokens and the 4 tokens still due."""
    broken = ScriptedDecode(break_after=1) if how == "breaks" else ScriptedDecode(end_after=1)
    prefill, spare = ScriptedPrefill(), ScriptedDecode()
    migrations_before = MIGRATIONS.labels("d0")._value.get()

    async def main():
        async with cluster(p0=prefill, d0=broken, d1=spare) as backend:
            chunks = await generate(backend, max_tokens=6, temperature=0.8, seed=5)
            assert_released(backend)
            return chunks

    chunks = asyncio.run(main())
    assert tokens(chunks) == SCRIPT[:6]  # no gap, no duplicate
    assert chunks[-1].finish_reason == "length"
    routes = [c.route for c in chunks if c.route is not None]
    assert routes[0].startswith("prefill=p0; decode=d0") and "migrations" not in routes[0]
    assert routes[1].startswith("prefill=p0; decode=d1") and routes[1].endswith("; migrations=1")
    resumed = spare.requests[0]
    assert (resumed.request_id, list(resumed.prompt_token_ids)) == ("req.1", PROMPT + SCRIPT[:2])
    params = resumed.sampling_params
    assert (params.max_tokens, params.num_prior_output_tokens, params.seed) == (4, 2, 5)
    assert list(prefill.requests[1].prompt_token_ids) == PROMPT + SCRIPT[:2]
    assert broken.ended == [("req", "failed" if how == "breaks" else "ended")]
    assert spare.ended == [("req.1", "finished")]
    assert MIGRATIONS.labels("d0")._value.get() == migrations_before + 1


def test_migrations_are_bounded():
    decodes = {f"d{i}": ScriptedDecode(break_after=1) for i in range(4)}

    async def main():
        async with cluster(FailoverPolicy(max_migrations=2), p0=ScriptedPrefill(), **decodes) as backend:
            sent = []
            with pytest.raises(BackendError, match="decode node d2: unavailable: Stream removed") as raised:
                async for chunk in backend.generate("req", PROMPT, SamplingParams(max_tokens=10)):
                    sent += chunk.token_ids
            assert_released(backend)
            return sent, raised.value

    sent, error = asyncio.run(main())
    assert error.kind == BackendErrorKind.UNAVAILABLE
    assert sent == SCRIPT[:6]  # two tokens per decode node: the first, two migrations, then the error
    assert [len(d.requests) for d in decodes.values()] == [1, 1, 1, 0]


def test_the_detokenizer_and_stop_strings_work_across_the_seam(tokenizer):
    """The break falls inside an emoji's bytes and inside the stop string: the text is whole."""
    text = "Café 😀 done.\nUser: more words that never show"
    script = tokenizer.encode(text, add_special_tokens=False)
    emoji_end = len(tokenizer.encode("Café 😀", add_special_tokens=False))
    stop_end = len(tokenizer.encode("Café 😀 done.\nUser:", add_special_tokens=False))
    assert emoji_end < stop_end < len(script)
    first = ScriptedDecode(break_after=emoji_end - 2, script=script)  # the emoji's last token not yet sent
    second = ScriptedDecode(break_after=stop_end - emoji_end - 2, script=script)  # inside "\nUser:"
    spec = ChoiceSpec(0, "req", PROMPT, SamplingParams(max_tokens=len(script)), stop=("\nUser:",))

    async def main():
        async with cluster(
            p0=ScriptedPrefill(script=script), d0=first, d1=second, d2=ScriptedDecode(script=script)
        ) as b:
            deltas = [delta async for delta in stream_choice(b, tokenizer, spec)]
            assert_released(b)
            return deltas

    deltas = asyncio.run(main())
    assert "".join(d.text for d in deltas) == "Café 😀 done."
    assert deltas[-1].finish_reason == "stop"
    assert not any("\ufffd" in d.text for d in deltas)
    routes = [d.route for d in deltas if d.route is not None]
    assert routes[0].startswith("prefill=p0; decode=d0") and "decode=d2" in routes[-1]
    assert routes[-1].endswith("; migrations=2")


def test_closing_the_stream_early_cancels_the_decode_call_and_releases_the_nodes():
    decode = ScriptedDecode(hang=True)

    async def main():
        async with cluster(p0=ScriptedPrefill(), d0=decode) as backend:
            assert [c.token_ids for c in await generate(backend, num_chunks=1)] == [SCRIPT[:1]]
            assert_released(backend)
            await asyncio.sleep(0.05)  # the cancellation reaches the decode node

    asyncio.run(main())
    assert decode.ended == [("req", "cancelled")]


def test_closing_a_resumed_stream_cancels_it_and_releases_the_nodes():
    broken, hanging = ScriptedDecode(break_after=1), ScriptedDecode(hang=True)

    async def main():
        async with cluster(p0=ScriptedPrefill(), d0=broken, d1=hanging) as backend:
            chunks = await generate(backend, num_chunks=3, max_tokens=8)  # the third: d1's first token
            assert_released(backend)
            await asyncio.sleep(0.05)  # the cancellation reaches the decode node
            return chunks

    assert tokens(asyncio.run(main())) == SCRIPT[:3]
    assert hanging.ended == [("req.1", "cancelled")]
