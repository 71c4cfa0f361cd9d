"""Decode and prefill servicers over real gRPC in one process, on the tiny model: the decode
node's side of a request's life (reservation, wait for blocks, lease, stream, release). Every
test runs twice: the gateway reading Generate over gRPC, and over the node's token stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from tests.decode_service import inprocess_pair
from tests.decode_service.inprocess_pair import (
    NUM_BLOCKS,
    Pair,
    block_engine,
    disaggregated_generate,
    free_blocks,
    run,
)


@pytest.fixture(autouse=True, params=inprocess_pair.TRANSPORTS)
def transport(request, monkeypatch) -> str:
    monkeypatch.setattr(inprocess_pair, "TRANSPORT", request.param)
    return request.param


def offline(tiny_llama_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_path), cache=CacheConfig(num_blocks=NUM_BLOCKS)))


def test_prefill_then_decode_equals_the_offline_engine(tiny_llama_path):
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario(pair: Pair):
        tokens, reserved = await disaggregated_generate(pair, "r", prompt, params)
        assert reserved.num_blocks == 3
        assert tokens == offline(tiny_llama_path).generate([prompt], params)[0].token_ids
        # Layer-wise: 2 layers x K/V x one page each, sent between layers of the forward pass.
        assert pair.sender.num_pages_sent == 4
        assert await pair.is_idle()  # the prefill node freed its blocks once the push was done

    run(tiny_llama_path, scenario)


def test_a_stream_interval_sends_the_same_tokens_in_fewer_chunks(tiny_llama_path):
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario(pair: Pair):
        call = pair.generate("r", prompt, params, local_prefill=True)  # colocated: the node computes the prompt
        assert (await call.read()).HasField("reserved")
        chunks = []
        while (message := await call.read()) is not grpc.aio.EOF:
            chunks.append(list(message.chunk.token_ids))
        # The first token at once (time to first token), then 3 per chunk, the last with the rest.
        assert [len(chunk) for chunk in chunks] == [1, 3, 3, 1]
        expected = offline(tiny_llama_path).generate([prompt], params)[0].token_ids
        assert [token for chunk in chunks for token in chunk] == expected
        assert await pair.is_idle()

    run(tiny_llama_path, scenario, stream_interval=3)


def test_a_prompt_queued_on_the_prefill_node_for_many_lease_periods_still_completes(tiny_llama_path):
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario(pair: Pair):
        block_engine(pair.prefill, 1.6)  # a queue ahead of the prompt: 4 lease periods
        tokens, _ = await disaggregated_generate(pair, "queued", prompt, params)
        assert tokens == offline(tiny_llama_path).generate([prompt], params)[0].token_ids
        assert pair.sender.num_renewals >= 6  # about every third of the lease period
        assert await pair.is_idle()

    run(tiny_llama_path, scenario, lease_s=0.4)


def test_pages_whose_lease_nobody_renews_free_the_blocks_and_fail_unavailable(tiny_llama_path):
    async def scenario(pair: Pair):
        call = pair.generate("orphan", list(range(40)), SamplingParams(max_tokens=4))  # no prefill node renews it
        assert (await call.read()).reserved.num_blocks == 3
        assert await free_blocks(pair.decode) == NUM_BLOCKS - 3
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lease expired (0.2 s without a renewal)" in error.value.details()
        assert await pair.is_idle()

    run(tiny_llama_path, scenario, lease_s=0.2)


def test_client_cancellation_aborts_and_frees_blocks(tiny_llama_path):
    async def scenario(pair: Pair):
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        call = pair.generate("c", list(range(40)), params, local_prefill=True)
        await call.read()  # reserved
        await call.read()  # first tokens
        call.cancel()
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_client_cancellation_while_the_pages_are_awaited_releases_the_reservation(tiny_llama_path):
    async def scenario(pair: Pair):
        call = pair.generate("c", list(range(40)), SamplingParams(max_tokens=4))
        await call.read()  # reserved
        call.cancel()
        assert await pair.is_idle()
        assert pair.receiver.renew(["c"]).released_request_ids == ["c"]  # a prefill node would drop it now

    run(tiny_llama_path, scenario)


def big_request(pair: Pair):
    """A prompt that takes all but one block of the pool."""
    return pair.generate("big", list(range(NUM_BLOCKS * 16 - 20)), SamplingParams(max_tokens=4))


def test_a_full_pool_makes_the_request_wait_until_blocks_free_up(tiny_llama_path):
    async def scenario(pair: Pair):
        big = big_request(pair)
        assert (await big.read()).reserved.num_blocks == NUM_BLOCKS - 1
        waiting = pair.generate("next", list(range(100)), SamplingParams(max_tokens=4))
        first = asyncio.ensure_future(waiting.read())
        await asyncio.sleep(0.3)
        assert not first.done()  # it waits for blocks rather than being refused
        big.cancel()  # its client went away: its blocks free up
        assert (await asyncio.wait_for(first, 2.0)).reserved.num_blocks == 7
        waiting.cancel()
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_a_pool_full_past_the_bound_is_refused_with_resource_exhausted(tiny_llama_path):
    async def scenario(pair: Pair):
        big = big_request(pair)
        await big.read()
        second = pair.generate("next", list(range(100)), SamplingParams(max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await second.read()
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.value.details() == "decode node had no free KV blocks for 0.3 s"
        big.cancel()
        assert await pair.is_idle()

    run(tiny_llama_path, scenario, max_reserve_wait_s=0.3)


def test_a_duplicate_of_a_live_request_id_fails_already_exists_and_leaves_the_first_call_alone(tiny_llama_path):
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario(pair: Pair):
        first = pair.generate("same", prompt, params)
        reserved = (await first.read()).reserved
        again = pair.generate("same", list(range(40)), SamplingParams(max_tokens=4))  # ids show in x-request-id
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await again.read()
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert await free_blocks(pair.decode) == NUM_BLOCKS - 3  # the duplicate reserved nothing, freed nothing
        first_token = (await pair.prefill_call("same", prompt, params, reserved)).first_token_id
        tokens = [first_token]
        while (message := await first.read()) is not grpc.aio.EOF:
            tokens += message.chunk.token_ids
        assert (
            tokens == offline(tiny_llama_path).generate([prompt], params)[0].token_ids
        )  # the first call never noticed
        retry = pair.generate("same", list(range(40)), SamplingParams(max_tokens=4))  # once it ended, the id is free
        assert (await retry.read()).reserved.num_blocks == 3
        retry.cancel()
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)


def test_the_caller_picks_no_deadline_and_an_unfilled_reservation_expires_with_its_lease(tiny_llama_path):
    async def scenario(pair: Pair):
        started = asyncio.get_running_loop().time()
        # The longest deadline the deprecated field can name (24.8 days): ignored.
        call = pair.generate("hog", list(range(40)), SamplingParams(max_tokens=1), kv_timeout_ms=2**31 - 1)
        reserved = (await call.read()).reserved
        assert await free_blocks(pair.decode) == NUM_BLOCKS - 3
        assert pair.receiver.renew(["hog"]).released_request_ids == ["hog"]  # its request id renews nothing
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()  # no page, no renewal under its token: the lease runs out
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert asyncio.get_running_loop().time() - started < 2.0
        assert await free_blocks(pair.decode) == NUM_BLOCKS
        assert pair.receiver.renew([reserved.reservation_token]).released_request_ids == [reserved.reservation_token]
        assert await pair.is_idle()

    run(tiny_llama_path, scenario, lease_s=0.3)


def test_second_chat_turn_pushes_only_the_blocks_the_decode_node_lacks(tiny_llama_path):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first_prompt = list(range(3, 43))  # 40 tokens

    async def scenario(pair: Pair):
        receiver = pair.receiver
        block_bytes = receiver.block_numel * receiver.dtype.itemsize
        bytes_per_block = receiver.num_layers * 2 * block_bytes  # every layer's K and V
        first_reply, reserved = await disaggregated_generate(pair, "turn-1", first_prompt, params)
        assert reserved.num_cached_blocks == 0 and reserved.num_blocks == 3
        assert receiver.num_bytes_received == 3 * bytes_per_block
        second_prompt = first_prompt + first_reply + list(range(50, 70))  # 68 tokens, 5 blocks
        second_reply, reserved = await disaggregated_generate(pair, "turn-2", second_prompt, params)
        # The first turn's prompt and reply (47 computed tokens: 2 full blocks) stayed cached.
        assert reserved.num_cached_blocks == 2 and reserved.num_blocks == 3
        assert receiver.num_bytes_received == 6 * bytes_per_block  # 3 of the 5 blocks moved
        assert pair.decode.engine.kv_cache_manager.num_prefix_hits == 32
        assert second_reply == offline(tiny_llama_path).generate([second_prompt], params)[0].token_ids
        assert await pair.is_idle()

    run(tiny_llama_path, scenario)
