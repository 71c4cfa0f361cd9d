"""The servers' event loop: uvloop's on Linux, where the project installs it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pdserve import event_loop


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not installed on Windows")
def test_servers_run_on_uvloop():
    async def main():
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(main()).startswith("uvloop")


def test_run_returns_the_result_and_closes_its_loop():
    loops = []

    async def main():
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return 42

    assert event_loop.run(main()) == 42
    assert loops[0].is_closed()
