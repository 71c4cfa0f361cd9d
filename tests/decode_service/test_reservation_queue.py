"""Waiting for free KV blocks: first come, first served, woken as blocks free up, bounded in time."""

from __future__ import annotations

import asyncio

import pytest

from decode_service.reservation_queue import ReservationQueue


class Pool:
    """A stand-in for the engine's block pool: `try_reserve(name)` takes one block or returns None."""

    def __init__(self, num_free: int) -> None:
        self.num_free = num_free
        self.tries: list[str] = []

    def try_reserve(self, name: str):
        async def attempt():
            self.tries.append(name)
            if self.num_free == 0:
                return None
            self.num_free -= 1
            return name

        return attempt


def test_a_free_block_is_reserved_at_once():
    pool, queue = Pool(1), ReservationQueue(max_wait_s=5)
    assert asyncio.run(queue.reserve(pool.try_reserve("a"))) == "a"
    assert pool.tries == ["a"] and queue.num_waiting == 0


def test_waiters_are_served_in_arrival_order_as_blocks_free_up():
    pool, queue = Pool(0), ReservationQueue(max_wait_s=5, retry_s=10)  # only notify() wakes them

    async def main():
        waiters = [asyncio.create_task(queue.reserve(pool.try_reserve(name))) for name in "abc"]
        await asyncio.sleep(0.05)
        assert pool.tries == ["a"] and queue.num_waiting == 3  # only the head tries
        for _ in range(3):
            pool.num_free += 1  # a request on the node ended
            queue.notify()
            await asyncio.sleep(0.01)
        return await asyncio.gather(*waiters)

    assert asyncio.run(main()) == ["a", "b", "c"]
    # A new head tries at once (none was free), then again at the next free block, and gets it.
    assert pool.tries == ["a", "a", "b", "b", "c", "c"]
    assert queue.num_waiting == 0


def test_the_head_retries_on_its_own_every_retry_s():
    pool, queue = Pool(0), ReservationQueue(max_wait_s=5, retry_s=0.05)

    async def main():
        waiter = asyncio.create_task(queue.reserve(pool.try_reserve("a")))
        await asyncio.sleep(0.12)
        pool.num_free = 1  # freed without a notify
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(main()) == "a"
    assert len(pool.tries) >= 3


def test_past_the_bound_the_answer_is_none_and_a_bound_of_zero_refuses_at_once():
    pool = Pool(0)

    async def main():
        start = asyncio.get_running_loop().time()
        assert await ReservationQueue(max_wait_s=0.1, retry_s=0.03).reserve(pool.try_reserve("late")) is None
        assert asyncio.get_running_loop().time() - start == pytest.approx(0.1, abs=0.08)
        assert await ReservationQueue(max_wait_s=0).reserve(pool.try_reserve("now")) is None

    asyncio.run(main())
    assert pool.tries.count("now") == 1


def test_a_cancelled_head_leaves_and_the_next_waiter_tries_at_once():
    pool, queue = Pool(0), ReservationQueue(max_wait_s=5, retry_s=10)

    async def main():
        head = asyncio.create_task(queue.reserve(pool.try_reserve("gone")))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(queue.reserve(pool.try_reserve("next")))
        await asyncio.sleep(0.01)
        pool.num_free = 1
        head.cancel()  # its client went away
        return await asyncio.wait_for(second, 1.0)

    assert asyncio.run(main()) == "next"
    assert queue.num_waiting == 0


def test_an_error_from_the_reservation_reaches_the_waiter_and_frees_its_place():
    queue = ReservationQueue(max_wait_s=5)

    async def refuse():
        raise ValueError("the whole cache could not hold it")

    async def main():
        with pytest.raises(ValueError, match="could not hold"):
            await queue.reserve(refuse)
        assert queue.num_waiting == 0

    asyncio.run(main())
