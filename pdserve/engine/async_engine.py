"""Runs an LLMEngine in its own thread and bridges it to asyncio callers.

Lifecycle:
  1. `start()` launches the engine thread (or `run_in_current_thread()` makes the caller's
     thread the engine thread: nodes use their main thread, where torch's CPU kernels run
     multi-threaded; from a secondary thread they ran about 1.5x slower here); it loops: run
     queued commands (add, abort, reserve, ...), then `step()` if any request is unfinished,
     else sleep until a command arrives;
  2. callers `await call(fn)` to run `fn(engine)` on the engine thread between two steps
     (the engine is never touched from two threads), and read a request's outputs from the
     asyncio queue that `open_stream` returned (with an interval of n tokens, the outputs of n
     steps arrive as one: the first and the last at once); or, once `write_directly` took, the
     engine thread hands each output to the caller's writer as it publishes it, and the queue
     gets only the last one, as `Written`;
  3. `stop()` ends the loop and joins the thread.
No forward pass ever runs on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestOutput
from pdserve.engine.scheduler import EngineLoad

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Owns the engine thread; mutates the engine only from that thread."""

    def __init__(self, engine: LLMEngine, output_observer: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.output_observer = output_observer  # sees every published output first (a node's metrics)
        self._commands: queue.SimpleQueue[
            tuple[Callable[[LLMEngine], Any], asyncio.Future, asyncio.AbstractEventLoop]
        ] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.load: EngineLoad = engine.load()  # refreshed on the engine thread every loop

    def start(self) -> None:
        self._thread.start()

    def run_in_current_thread(self) -> None:
        """Runs the engine loop here until `stop()` is called from another thread."""
        self._run()

    def stop(self) -> None:
        self._stopping.set()
        self.submit(lambda engine: None)  # wakes the loop
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) on the engine thread; returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, future, loop))
        return await future

    def open_stream(self, request_id: str, interval: int = 1) -> asyncio.Queue:
        """Queue that receives the request's RequestOutputs, on the caller's event loop: its first
        output at once, then one per `interval` new tokens (outputs merged), and the last at once."""
        if interval < 1:
            raise ValueError(f"a stream interval is at least 1 token, not {interval}")
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), interval)
        with self._streams_lock:
            self._streams[request_id] = stream
        return stream.queue

    def write_directly(self, request_id: str, write: Callable[[RequestOutput], None], num_received: int) -> bool:
        """From now on the engine thread passes the stream's outputs to `write` (thread-safe, must not
        block) as it publishes them, and the queue receives only the last one, wrapped in `Written`.
        Takes only once the caller has received all `num_received` outputs delivered so far (else
        False: try again after reading the queue), so that no output overtakes an earlier one.

        Why: a streamed token then costs the event loop's thread nothing. Woken per token, that
        thread took the GIL from the engine thread and a core from its kernels (docs/benchmarks.md,
        eighteenth pass)."""
        with self._streams_lock:
            stream = self._streams.get(request_id)
            if stream is None or stream.num_delivered != num_received:
                return False
            stream.write = write
            return True

    def close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    @property
    def num_open_streams(self) -> int:
        """Streams opened and not closed yet: 0 on an idle node, whatever its calls went through."""
        with self._streams_lock:
            return len(self._streams)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to their streams (thread-safe: may run on the engine thread)."""
        if self.output_observer is not None:
            self.output_observer(outputs)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | Written]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None or (due := stream.add(output)) is None:
                    continue
                if stream.write is not None and _written(stream, due):
                    if not due.finished:
                        continue
                    due = Written(due)
                stream.num_delivered += 1
                deliveries.setdefault(stream.loop, []).append((stream.queue, due))
        # One wake-up per loop and step, not one per stream: each is a write to the loop's pipe.
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Queues fn(engine) without waiting (safe from cleanup code that may be cancelled)."""
        self._commands.put((fn, None, None))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._run_commands(block=not self.engine.has_unfinished_requests)
            if not self._stopping.is_set() and self.engine.has_unfinished_requests:
                self._step()
            self.load = self.engine.load()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # a broken step must not kill the node silently
            logger.exception("engine step failed")
            raise
        self.publish(outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, fn, future, loop) -> None:
        if future is None:  # submitted without a waiter
            try:
                fn(self.engine)
            except Exception:
                logger.exception("engine command failed")
            return
        try:
            result = fn(self.engine)
        except BaseException as error:  # handed to the awaiting caller
            loop.call_soon_threadsafe(_set_exception, future, error)
        else:
            loop.call_soon_threadsafe(_set_result, future, result)


@dataclasses.dataclass(frozen=True)
class Written:
    """A stream's last output, which its writer has had already (`write_directly`)."""

    output: RequestOutput


def _written(stream: _Stream, output: RequestOutput) -> bool:
    """Hands `output` to the stream's writer; a writer that fails is dropped, and this output and
    the later ones go through the queue after what it wrote."""
    try:
        stream.write(output)
        return True
    except Exception:
        logger.exception(
            "request %s: writing its output directly failed; streaming it through the queue", output.request_id
        )
        stream.write = None
        return False


@dataclasses.dataclass
class _Stream:
    """Where one request's outputs go, and the tokens held back until its interval is full."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    interval: int
    held: RequestOutput | None = None
    delivered_first: bool = False
    num_delivered: int = 0  # items put on the queue
    write: Callable[[RequestOutput], None] | None = None  # set by write_directly

    def add(self, output: RequestOutput) -> RequestOutput | None:
        """The output to deliver now (merged with those held back), or None to hold it."""
        if self.held is not None:
            output = dataclasses.replace(
                output,
                new_token_ids=self.held.new_token_ids + output.new_token_ids,
                new_logprobs=self.held.new_logprobs + output.new_logprobs,
            )
        if output.finished or not self.delivered_first or len(output.new_token_ids) >= self.interval:
            self.held = None
            self.delivered_first = True
            return output
        self.held = output
        return None


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput | Written]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
