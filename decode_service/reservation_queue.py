"""A decode node's wait for free KV blocks: a request that finds the pool full waits its turn,
within a bound, instead of being refused at once (the pool is often full only for the moment:
running streams finish and free their blocks every step).

Lifecycle of one waiter (all on the event loop):
  1. it queues behind the waiters already there (first come, first served: a small prompt does
     not starve a large one); at the head, it tries at once;
  2. the head tries again whenever a request on this node ends (`notify`; its blocks are free by
     the time the retry runs, since the retry is an engine command queued after the free or the
     abort), and every `retry_s` in case;
  3. it leaves with a reservation, or with None once `max_wait_s` has passed (the servicer then
     refuses the request); a cancelled waiter just leaves. The head that leaves wakes the next.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class ReservationQueue:
    """Owns the queue of waiters, nothing else: the reservation itself is the caller's `try_reserve`."""

    def __init__(self, max_wait_s: float, retry_s: float = 0.5) -> None:
        if max_wait_s < 0 or retry_s <= 0:
            raise ValueError(f"max_wait_s must be >= 0 and retry_s > 0, got {max_wait_s} and {retry_s}")
        self.max_wait_s = max_wait_s
        self.retry_s = retry_s
        self._waiters: deque[asyncio.Event] = deque()  # each waiter's wake-up; the head's turn to try

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def reserve(self, try_reserve: Callable[[], Awaitable[T | None]]) -> T | None:
        """`try_reserve()`'s first result that is not None, tried in turn; None after max_wait_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        turn = asyncio.Event()
        self._waiters.append(turn)
        try:
            while True:
                is_head = self._waiters[0] is turn
                if is_head:
                    turn.clear()  # a notify from here on means: blocks were freed, try again
                    if (reservation := await try_reserve()) is not None:
                        return reservation
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(turn.wait(), min(remaining, self.retry_s) if is_head else remaining)
        finally:
            self._leave(turn)

    def notify(self) -> None:
        """Blocks were freed, or will be before the head's next try runs: the head tries again."""
        if self._waiters:
            self._waiters[0].set()

    def _leave(self, turn: asyncio.Event) -> None:
        was_head = self._waiters[0] is turn
        self._waiters.remove(turn)
        if was_head:
            self.notify()  # the next in line tries at once
