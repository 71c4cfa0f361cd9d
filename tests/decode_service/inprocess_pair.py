"""A decode and a prefill servicer on one in-process gRPC server over the fake KV transport, on
the tiny model: what the decode and prefill servicer tests drive, the way the gateway does. The
decode servicer's Generate is also served on a token stream (decode_service/token_stream_server.py);
`TRANSPORT` says which of the two `Pair.generate` calls (test_servicer.py runs its tests over both)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from decode_service.servicer import DecodeServicer
from decode_service.token_stream_server import TokenStreamServer
from kvtransfer.base import DEFAULT_LEASE_S, KvReceiver
from kvtransfer.fake import FakeKvSender
from kvtransfer.lease_keeper import LeaseKeeper
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.scheduler import EngineLoad
from prefill_service.servicer import KvPushes, PrefillServicer
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from protos.convert import sampling_params_to_proto
from protos.token_stream import TokenStreamCall

NUM_BLOCKS = 32
TRANSPORTS = ("grpc", "token_stream")
TRANSPORT = "grpc"  # what Pair.generate uses


@dataclass
class Pair:
    server: grpc.aio.Server
    decode: AsyncEngine
    prefill: AsyncEngine
    receiver: KvReceiver  # the decode node's
    sender: FakeKvSender  # the prefill node's, delivering to `receiver` under the address "decode"
    prefill_servicer: PrefillServicer
    port: int
    token_stream: TokenStreamServer
    token_stream_port: int
    channel: grpc.aio.Channel | None = None

    def generate(self, rid: str, prompt: list[int], params: SamplingParams, **kw):
        """The decode node's Generate stream (its first message is `reserved`), over TRANSPORT."""
        request = generate_request(rid, prompt, params, **kw)
        if TRANSPORT == "token_stream":
            return TokenStreamCall(f"127.0.0.1:{self.token_stream_port}", request)
        return decode_pb2_grpc.DecodeServiceStub(self.channel).Generate(request)

    def prefill_call(self, rid: str, prompt: list[int], params: SamplingParams, reserved: decode_pb2.Reserved):
        request = prefill_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(params),
            decode_address="decode",
            reservation_token=reserved.reservation_token,
        )
        return prefill_pb2_grpc.PrefillServiceStub(self.channel).Prefill(request)

    async def is_idle(self) -> bool:
        """Nothing held anywhere: no request, reservation, pending transfer, held page, open
        stream, push or lease, and every block free. Cleanup may finish just after a call ends."""
        for _ in range(60):
            if await self._idle_now():
                return True
            await asyncio.sleep(0.05)
        return False

    async def _idle_now(self) -> bool:
        idle_load = EngineLoad(num_free_blocks=NUM_BLOCKS)
        for engine in (self.decode, self.prefill):
            if await engine.call(lambda e: e.load() != idle_load or e.scheduler.requests) or engine.num_open_streams:
                return False
        servicer = self.prefill_servicer
        return not (
            self.token_stream.num_open_calls
            or self.receiver.reservations
            or len(servicer.pushes)
            or servicer.leases.num_leases
        )


def engine_for(path, layer_hook=None) -> AsyncEngine:
    config = EngineConfig(model=str(path), cache=CacheConfig(num_blocks=NUM_BLOCKS))
    return AsyncEngine(LLMEngine(config, layer_hook=layer_hook))


async def serve(
    path, lease_s: float = DEFAULT_LEASE_S, max_reserve_wait_s: float = 5.0, decode_nodes=None, stream_interval: int = 1
) -> Pair:
    pushes = KvPushes()
    decode, prefill = engine_for(path), engine_for(path, pushes.on_layer_computed)
    decode.start()
    prefill.start()
    receiver = KvReceiver(decode.engine.kv_caches, lease_s=lease_s)
    server = grpc.aio.server()
    servicer = DecodeServicer(decode, receiver, max_reserve_wait_s, stream_interval)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    sender = FakeKvSender({"decode": receiver})
    prefill_servicer = PrefillServicer(prefill, sender, pushes, LeaseKeeper(sender, lease_s), decode_nodes)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    token_stream = TokenStreamServer(servicer)
    token_stream_port = await token_stream.start("127.0.0.1", 0)
    return Pair(server, decode, prefill, receiver, sender, prefill_servicer, port, token_stream, token_stream_port)


def run(path, scenario, **serve_kw) -> None:
    """Runs `await scenario(pair)` against a fresh pair, then stops it."""

    async def main():
        pair = await serve(path, **serve_kw)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
                pair.channel = channel
                await scenario(pair)
        finally:
            await pair.token_stream.stop(0)
            await pair.server.stop(0)
            await pair.prefill_servicer.close()
            pair.decode.stop()
            pair.prefill.stop()

    asyncio.run(main())


def generate_request(rid, prompt, params, **kw):
    return decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=sampling_params_to_proto(params), **kw
    )


async def disaggregated_generate(pair: Pair, rid, prompt, params) -> tuple[list[int], decode_pb2.Reserved]:
    """What the gateway does: reserve on the decode node, prefill with its reservation, stream."""
    call = pair.generate(rid, prompt, params)
    reserved = (await call.read()).reserved
    first = await pair.prefill_call(rid, prompt, params, reserved)
    tokens = [first.first_token_id]
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens += message.chunk.token_ids
    return tokens, reserved


async def free_blocks(async_engine: AsyncEngine) -> int:
    return await async_engine.call(lambda engine: engine.kv_cache_manager.num_free_blocks)


def block_engine(async_engine: AsyncEngine, seconds: float) -> None:
    """Keeps the engine thread busy for `seconds`, as a long queue of prompts ahead would."""
    async_engine.submit(lambda engine: time.sleep(seconds))
