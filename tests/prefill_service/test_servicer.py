"""The prefill node's side of a request's life, over real gRPC in one process on the tiny model:
a prompt whose decode side gave up is never computed, and every call, however it ends, leaves
nothing held (no pending transfer, held page, push, lease or stream)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest

from pdserve.engine import SamplingParams
from protos import prefill_pb2, prefill_pb2_grpc
from protos.convert import sampling_params_to_proto
from tests.decode_service.inprocess_pair import Pair, block_engine, run

PROMPT, PARAMS = list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True)


async def reserve(pair: Pair, rid: str):
    call = pair.generate(rid, PROMPT, PARAMS)
    return call, (await call.read()).reserved


def test_a_call_cancelled_while_its_prompt_is_being_added_leaks_nothing(tiny_llama_path):
    """The leak behind 'num_pending_transfers: 1 with nothing in flight': a Prefill call
    cancelled while its add_request waited for the engine thread left the prompt to be computed,
    and its pages held, for good."""

    async def scenario(pair: Pair):
        decode_call, reserved = await reserve(pair, "r")
        block_engine(pair.prefill, 0.3)  # the add waits behind the current step
        prefill_call = pair.prefill_call("r", PROMPT, PARAMS, reserved)
        await asyncio.sleep(0.1)
        prefill_call.cancel()  # the gateway's client went away
        decode_call.cancel()
        assert await pair.is_idle()
        assert pair.prefill.engine.kv_cache_manager.num_prefix_queries == 0  # never computed

    run(tiny_llama_path, scenario)


def test_a_prompt_whose_decode_reservation_is_gone_is_dropped_before_it_is_computed(tiny_llama_path):
    async def scenario(pair: Pair):
        decode_call, reserved = await reserve(pair, "r")
        block_engine(pair.prefill, 0.5)  # the prompt waits in the prefill queue
        prefill_call = pair.prefill_call("r", PROMPT, PARAMS, reserved)
        await asyncio.sleep(0.05)
        decode_call.cancel()  # only the decode side hears that the client went away
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await prefill_call
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert "decode node decode: it released the blocks" in error.value.details()
        assert await pair.is_idle()
        assert pair.prefill.engine.kv_cache_manager.num_prefix_queries == 0  # never computed

    run(tiny_llama_path, scenario, lease_s=0.3)


def test_a_prompt_whose_decode_node_is_gone_is_dropped_after_a_lease_period(tiny_llama_path):
    async def scenario(pair: Pair):
        decode_call, reserved = await reserve(pair, "r")
        pair.sender.unreachable.add("decode")  # the decode node died: renewals fail
        block_engine(pair.prefill, 1.0)
        prefill_call = pair.prefill_call("r", PROMPT, PARAMS, reserved)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await prefill_call
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert "no renewal reached it for 0.3 s" in error.value.details()
        decode_call.cancel()
        assert await pair.is_idle()
        assert pair.prefill.engine.kv_cache_manager.num_prefix_queries == 0

    run(tiny_llama_path, scenario, lease_s=0.3)


def test_a_first_token_that_ends_the_request_releases_the_prompt_pages_at_once(tiny_llama_path):
    async def scenario(pair: Pair):
        params = SamplingParams(max_tokens=1)
        decode_call = pair.generate("one", PROMPT, params)
        reserved = (await decode_call.read()).reserved
        first = await pair.prefill_call("one", PROMPT, params, reserved)
        assert first.finished and first.finish_reason == "length"
        decode_call.cancel()  # what the gateway does: no commit comes
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_calls_cancelled_at_any_point_leave_both_nodes_idle(tiny_llama_path):
    rng = random.Random(11)

    async def one(pair: Pair, rid: str, cancel_after_s: float) -> None:
        async def gateway():  # reserve, prefill, stream; cancels the decode call however it ends
            call = pair.generate(rid, [rng.randrange(500) for _ in range(rng.randrange(5, 60))], PARAMS)
            try:
                reserved = (await call.read()).reserved
                await pair.prefill_call(rid, list(range(3, 3 + 16 * reserved.num_blocks)), PARAMS, reserved)
                while await call.read() is not grpc.aio.EOF:
                    pass
            finally:
                call.cancel()

        task = asyncio.create_task(gateway())
        await asyncio.sleep(cancel_after_s)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    async def scenario(pair: Pair):
        await asyncio.gather(*(one(pair, f"r{i}", rng.random() * 0.3) for i in range(24)))
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_a_prefill_names_no_blocks_and_a_forged_token_or_address_writes_nothing(tiny_llama_path):
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0)

    async def scenario(pair: Pair):
        call = pair.generate("victim", prompt, params)
        reserved = (await call.read()).reserved
        assert len(reserved.reservation_token) >= 20  # random, not the request id
        forged = [
            ("decode", "victim"),  # the request id, as x-request-id shows it
            ("decode", "guessed-token"),
            ("elsewhere:1", reserved.reservation_token),  # an address that is no decode node here
        ]
        for address, token in forged:
            request = prefill_pb2.PrefillRequest(
                request_id="attack",
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(params),
                decode_address=address,
                reservation_token=token,
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await prefill_pb2_grpc.PrefillServiceStub(pair.channel).Prefill(request)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert pair.sender.num_pages_sent == 0
        await pair.prefill_call("victim", prompt, params, reserved)  # the real reservation is untouched
        while await call.read() is not grpc.aio.EOF:
            pass
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


class KnownDecodeNodes:
    """A DecodeNodeDirectory over a fixed set of addresses, recording what it was asked."""

    def __init__(self, addresses: set[str]) -> None:
        self.addresses, self.asked = addresses, []

    async def is_decode_node(self, address: str) -> bool:
        self.asked.append(address)
        return address in self.addresses


def test_a_prefill_naming_an_unregistered_decode_address_is_refused_before_anything_dials_it(tiny_llama_path):
    directory = KnownDecodeNodes({"decode"})

    async def scenario(pair: Pair):
        call, reserved = await reserve(pair, "victim")
        request = prefill_pb2.PrefillRequest(
            request_id="attack",
            prompt_token_ids=PROMPT,
            sampling_params=sampling_params_to_proto(PARAMS),
            decode_address="127.0.0.1:9",  # any socket the caller likes
            reservation_token=reserved.reservation_token,
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await prefill_pb2_grpc.PrefillServiceStub(pair.channel).Prefill(request)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not a registered decode node" in error.value.details()
        await pair.prefill_call("victim", PROMPT, PARAMS, reserved)  # a registered one goes through
        while await call.read() is not grpc.aio.EOF:
            pass
        assert directory.asked == ["127.0.0.1:9", "decode"]
        assert await pair.is_idle()

    run(tiny_llama_path, scenario, decode_nodes=directory)
