"""AsyncEngine.publish: a step's outputs reach each stream's queue on that stream's loop, in
order, with one wake-up per loop and step (not one per stream); or, after write_directly, the
caller's writer on the engine thread, with only the last output on the queue."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine.async_engine import AsyncEngine, Written
from pdserve.engine.request import RequestOutput


class IdleEngine:
    def load(self):
        return None


def output(request_id: str, token_id: int) -> RequestOutput:
    return RequestOutput(request_id, [token_id], [], False, None, num_prompt_tokens=1, num_cached_tokens=0)


def test_a_steps_outputs_reach_their_streams_with_one_wake_up_per_loop():
    engine = AsyncEngine(IdleEngine())
    other_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=other_loop.run_forever)
    thread.start()

    async def open_remote() -> asyncio.Queue:
        return engine.open_stream("c")

    async def body():
        loop = asyncio.get_running_loop()
        wake_ups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: wake_ups.append(args) or real(*args)
        a, b = engine.open_stream("a"), engine.open_stream("b")
        c = asyncio.run_coroutine_threadsafe(open_remote(), other_loop).result()
        steps = [[output("a", s), output("b", 10 + s), output("c", 20 + s), output("gone", 0)] for s in range(3)]
        publisher = threading.Thread(target=lambda: [engine.publish(outputs) for outputs in steps])
        publisher.start()  # from another thread, as the engine thread publishes
        publisher.join()
        got_a = [(await a.get()).new_token_ids[0] for _ in range(3)]
        got_b = [(await b.get()).new_token_ids[0] for _ in range(3)]
        assert got_a == [0, 1, 2] and got_b == [10, 11, 12]
        assert len(wake_ups) == 3  # one per step for both streams of this loop
        return c

    try:
        c = asyncio.run(body())
        got_c = [asyncio.run_coroutine_threadsafe(c.get(), other_loop).result(5).new_token_ids[0] for _ in range(3)]
        assert got_c == [20, 21, 22]
    finally:
        other_loop.call_soon_threadsafe(other_loop.stop)
        thread.join(5)
        other_loop.close()


def test_a_stream_interval_merges_outputs_but_sends_the_first_and_the_last_at_once():
    engine = AsyncEngine(IdleEngine())

    async def body():
        stream = engine.open_stream("a", interval=3)
        finished = RequestOutput("a", [7], [], True, "length", num_prompt_tokens=1, num_cached_tokens=0)
        steps = [[output("a", token)] for token in range(5)] + [[finished]]
        publisher = threading.Thread(target=lambda: [engine.publish(outputs) for outputs in steps])
        publisher.start()
        publisher.join()
        chunks = [await stream.get() for _ in range(3)]
        assert [chunk.new_token_ids for chunk in chunks] == [[0], [1, 2, 3], [4, 7]]
        assert [chunk.finish_reason for chunk in chunks] == [None, None, "length"]
        assert stream.empty()

    asyncio.run(body())


def test_a_stream_interval_below_one_token_is_refused():
    engine = AsyncEngine(IdleEngine())

    async def body():
        with pytest.raises(ValueError, match="at least 1 token"):
            engine.open_stream("a", interval=0)

    asyncio.run(body())


def finished_output(request_id: str, token_id: int) -> RequestOutput:
    return RequestOutput(request_id, [token_id], [], True, "length", num_prompt_tokens=1, num_cached_tokens=0)


def publish_from_another_thread(engine: AsyncEngine, steps: list[list[RequestOutput]]) -> None:
    publisher = threading.Thread(target=lambda: [engine.publish(outputs) for outputs in steps])
    publisher.start()  # as the engine thread publishes
    publisher.join()


def test_a_direct_writer_gets_every_output_and_the_queue_only_the_last_as_written():
    engine = AsyncEngine(IdleEngine())

    async def body():
        stream, written = engine.open_stream("a", interval=2), []
        assert engine.write_directly("a", written.append, num_received=0)
        publish_from_another_thread(engine, [[output("a", t)] for t in range(4)] + [[finished_output("a", 9)]])
        assert [o.new_token_ids for o in written] == [[0], [1, 2], [3, 9]]  # the interval still merges
        last = await stream.get()
        assert isinstance(last, Written) and last.output is written[-1] and stream.empty()

    asyncio.run(body())


def test_a_direct_writer_waits_until_the_caller_has_read_what_the_queue_holds():
    # Taking over while an output sits in the queue would let the next one overtake it.
    engine = AsyncEngine(IdleEngine())

    async def body():
        stream, written = engine.open_stream("a"), []
        publish_from_another_thread(engine, [[output("a", 0)]])
        assert not engine.write_directly("a", written.append, num_received=0)
        assert (await stream.get()).new_token_ids == [0]
        assert engine.write_directly("a", written.append, num_received=1)
        publish_from_another_thread(engine, [[output("a", 1)]])
        assert [o.new_token_ids for o in written] == [[1]] and stream.empty()
        assert not engine.write_directly("gone", written.append, num_received=0)

    asyncio.run(body())


def test_a_failing_direct_writer_hands_that_output_and_the_later_ones_to_the_queue():
    engine = AsyncEngine(IdleEngine())
    attempts = []

    def broken(out: RequestOutput) -> None:
        attempts.append(out)
        raise OSError("socket gone")

    async def body():
        stream = engine.open_stream("a")
        assert engine.write_directly("a", broken, num_received=0)
        publish_from_another_thread(engine, [[output("a", 0)], [output("a", 1)], [finished_output("a", 2)]])
        got = [await stream.get() for _ in range(3)]
        assert [o.new_token_ids for o in got] == [[0], [1], [2]] and not any(isinstance(o, Written) for o in got)
        assert len(attempts) == 1  # dropped after its first failure

    asyncio.run(body())
