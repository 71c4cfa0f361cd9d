"""`PDSERVE_CPU_ISA=avx2`: the C++ kernels built for an AVX2-only machine (many AMD EPYC hosts)
compute what the native build computes, and hold no AVX-512 instruction. Runs the kernels' own
tests in a child process with that build and with torch's kernels held to AVX2 too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.cpu_kernels import cpu_isa

REPO = Path(__file__).resolve().parents[3]
KERNEL_TESTS = [
    "tests/pdserve/engine/test_quantization.py",
    "tests/pdserve/engine/test_cpu_attention.py",
    "tests/pdserve/engine/test_cpu_decode.py",
    "tests/pdserve/engine/test_dense_gemv.py",
]
AVX2_ENV = {"PDSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run_as_avx2(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=os.environ | AVX2_ENV, capture_output=True, text=True, timeout=timeout
    )


def test_an_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx10")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA must be one of native, avx2"):
        cpu_isa()


def test_the_avx2_build_holds_no_avx512_instruction():
    loaded = run_as_avx2("-c", "from pdserve.engine.cpu_kernels import cpu_kernels; print(cpu_kernels().__file__)")
    assert loaded.returncode == 0, loaded.stderr
    library = loaded.stdout.strip().splitlines()[-1]
    disassembly = subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=True).stdout
    assert "%ymm" in disassembly  # vectorized, with AVX2's registers
    assert "%zmm" not in disassembly


def test_the_kernels_tests_pass_on_the_avx2_build():
    result = run_as_avx2("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *KERNEL_TESTS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
