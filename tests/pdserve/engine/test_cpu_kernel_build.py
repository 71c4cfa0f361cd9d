"""Building the C++ kernels survives a build that was killed, and builds take turns."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine.cpu_kernels import cpu_kernels, exclusive_build

REPO = Path(__file__).resolve().parents[3]
LOAD = "from pdserve.engine.cpu_kernels import cpu_kernels; print(cpu_kernels().__file__)"


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """Measured: a node killed while compiling left torch's `lock` file, and every later start
    waited on it forever ("loading pdserve's CPU kernels" and nothing after)."""
    built = Path(cpu_kernels().__file__).parent
    copy = tmp_path / built.name
    shutil.copytree(built, copy)  # keeps the mtimes: ninja finds nothing to rebuild
    (copy / "lock").touch()
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    command = [sys.executable, "-c", LOAD]
    loaded = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip().splitlines()[-1].startswith(str(copy))
    assert "left by a build that was killed" in loaded.stderr
    assert not (copy / "lock").exists()


def test_a_second_build_waits_for_the_first(tmp_path):
    hold = (
        "import sys, time; from pathlib import Path; from pdserve.engine.cpu_kernels import exclusive_build\n"
        "with exclusive_build(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(1.0)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").touch()  # the live build's own lock: not removed while it builds
        start = time.monotonic()
        with exclusive_build(tmp_path):
            waited = time.monotonic() - start
            assert waited > 0.5
            assert not (tmp_path / "lock").exists()  # its owner ended without removing it
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0


@pytest.mark.parametrize("exists", [True, False])
def test_the_build_folder_is_made_when_missing(tmp_path, exists):
    folder = tmp_path / "kernels"
    if exists:
        folder.mkdir()
    with exclusive_build(folder):
        assert folder.is_dir()
