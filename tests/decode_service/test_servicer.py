"""Decode and prefill servicers over real gRPC in one process, on the tiny model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_service.servicer import DecodeServicer
from kvtransfer.base import KvReceiver
from kvtransfer.fake import FakeKvSender
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from prefill_service.servicer import KvPushes, PrefillServicer
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from protos.convert import sampling_params_to_proto

NUM_BLOCKS = 32


def engine_for(path, layer_hook=None) -> AsyncEngine:
    config = EngineConfig(model=str(path), cache=CacheConfig(num_blocks=NUM_BLOCKS))
    return AsyncEngine(LLMEngine(config, layer_hook=layer_hook))


async def serve(tiny_llama_path):
    pushes = KvPushes()
    decode_engine, prefill_engine = engine_for(tiny_llama_path), engine_for(tiny_llama_path, pushes.on_layer_computed)
    decode_engine.start()
    prefill_engine.start()
    receiver = KvReceiver(decode_engine.engine.kv_caches)
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(decode_engine, receiver, 5.0), server)
    sender = FakeKvSender({"decode": receiver})
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(prefill_engine, sender, pushes), server)
    prefill_engine.sender = sender  # for assertions
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, decode_engine, prefill_engine


def generate_request(rid, prompt, params, **kw):
    return decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=sampling_params_to_proto(params), **kw
    )


async def free_blocks(async_engine: AsyncEngine) -> int:
    return await async_engine.call(lambda engine: engine.kv_cache_manager.num_free_blocks)


async def all_blocks_freed(async_engine: AsyncEngine) -> bool:
    """The servicer frees blocks in its cleanup, which may run just after the client saw the end."""
    for _ in range(50):
        if await free_blocks(async_engine) == NUM_BLOCKS:
            return True
        await asyncio.sleep(0.05)
    return False


def run(tiny_llama_path, scenario):
    async def main():
        server, port, decode_engine, prefill_engine = await serve(tiny_llama_path)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await scenario(channel, decode_engine, prefill_engine)
        finally:
            await server.stop(0)
            decode_engine.stop()
            prefill_engine.stop()

    asyncio.run(main())


def test_prefill_then_decode_equals_the_offline_engine(tiny_llama_path):
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario(channel, decode_engine, prefill_engine):
        call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(generate_request("r", prompt, params))
        assert (await call.read()).reserved.num_blocks == 3
        first = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
            prefill_pb2.PrefillRequest(
                request_id="r",
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(params),
                decode_address="decode",
            )
        )
        tokens = [first.first_token_id]
        while (message := await call.read()) is not grpc.aio.EOF:
            tokens += message.chunk.token_ids
        offline = LLMEngine(EngineConfig(model=str(tiny_llama_path), cache=CacheConfig(num_blocks=NUM_BLOCKS)))
        assert tokens == offline.generate([prompt], params)[0].token_ids
        # Layer-wise: 2 layers x K/V x one page each, sent between layers of the forward pass.
        assert prefill_engine.sender.num_pages_sent == 4
        assert await all_blocks_freed(decode_engine)
        assert await all_blocks_freed(prefill_engine)  # once the push is done

    run(tiny_llama_path, scenario)


def test_pages_that_never_arrive_free_the_blocks_and_fail_unavailable(tiny_llama_path):
    async def scenario(channel, decode_engine, _):
        call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(
            generate_request("late", list(range(40)), SamplingParams(max_tokens=4), kv_timeout_ms=200)
        )
        assert (await call.read()).reserved.num_blocks == 3
        assert await free_blocks(decode_engine) == NUM_BLOCKS - 3
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await all_blocks_freed(decode_engine)

    run(tiny_llama_path, scenario)


def test_client_cancellation_aborts_and_frees_blocks(tiny_llama_path):
    async def scenario(channel, decode_engine, _):
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(
            generate_request("c", list(range(40)), params, local_prefill=True)
        )
        await call.read()  # reserved
        await call.read()  # first tokens
        call.cancel()
        assert await all_blocks_freed(decode_engine)
        assert not await decode_engine.call(lambda engine: engine.has_unfinished_requests)

    run(tiny_llama_path, scenario)


def test_full_pool_is_refused_with_resource_exhausted(tiny_llama_path):
    async def scenario(channel, _, __):
        call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(
            generate_request("big", list(range(NUM_BLOCKS * 16 - 20)), SamplingParams(max_tokens=4))
        )
        await call.read()
        second = decode_pb2_grpc.DecodeServiceStub(channel).Generate(
            generate_request("next", list(range(100)), SamplingParams(max_tokens=4))
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await second.read()
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()

    run(tiny_llama_path, scenario)


async def disaggregated_generate(channel, rid, prompt, params) -> tuple[list[int], decode_pb2.Reserved]:
    """What the gateway does: reserve on the decode node, prefill with its reservation, stream."""
    call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(generate_request(rid, prompt, params))
    reserved = (await call.read()).reserved
    first = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
        prefill_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(params),
            decode_address="decode",
            decode_block_ids=reserved.block_ids,
            decode_num_cached_blocks=reserved.num_cached_blocks,
        )
    )
    tokens = [first.first_token_id]
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens += message.chunk.token_ids
    return tokens, reserved


def test_second_chat_turn_pushes_only_the_blocks_the_decode_node_lacks(tiny_llama_path):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first_prompt = list(range(3, 43))  # 40 tokens

    async def scenario(channel, decode_engine, prefill_engine):
        receiver = prefill_engine.sender.receivers["decode"]
        bytes_per_block = receiver.num_layers * 2 * receiver.block_bytes  # every layer's K and V
        first_reply, reserved = await disaggregated_generate(channel, "turn-1", first_prompt, params)
        assert reserved.num_cached_blocks == 0 and reserved.num_blocks == 3
        assert receiver.num_bytes_received == 3 * bytes_per_block
        second_prompt = first_prompt + first_reply + list(range(50, 70))  # 68 tokens, 5 blocks
        second_reply, reserved = await disaggregated_generate(channel, "turn-2", second_prompt, params)
        # The first turn's prompt and reply (47 computed tokens: 2 full blocks) stayed cached.
        assert reserved.num_cached_blocks == 2 and reserved.num_blocks == 3
        assert receiver.num_bytes_received == 6 * bytes_per_block  # 3 of the 5 blocks moved
        assert decode_engine.engine.kv_cache_manager.num_prefix_hits == 32
        offline = LLMEngine(EngineConfig(model=str(tiny_llama_path), cache=CacheConfig(num_blocks=NUM_BLOCKS)))
        assert second_reply == offline.generate([second_prompt], params)[0].token_ids
        assert await all_blocks_freed(decode_engine)

    run(tiny_llama_path, scenario)
