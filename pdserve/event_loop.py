"""The event loop of the long-running servers (the gateway, and a node's RPC thread) and of the
benchmark clients: uvloop's, where it is installed, else asyncio's.

Each streamed token costs these loops a gRPC message, a socket write and a wake-up, and on a
small CPU machine every millisecond of it is taken from the engine's threads. On a 2-core AMD
EPYC at one stream, uvloop (with httptools) cut the gateway's CPU per token from 1.5-1.6 ms to 1.2-1.5
ms (docs/benchmarks.md). grpc.aio runs on it as on asyncio's loop. A benchmark's client shares the
machine with the server it measures, so it takes the lighter loop too (a 32-stream run of 4096
tokens: 3.05 -> 2.71 s of client CPU).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

try:
    from uvloop import new_event_loop
except ImportError:  # not built for this platform (Windows): asyncio's own loop
    new_event_loop = None

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the fastest loop available."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
