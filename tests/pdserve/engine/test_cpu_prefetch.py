"""`PDSERVE_CPU_PREFETCH`: how batch-1 int8 GEMVs stream their weights (left to the hardware
prefetchers, or with software prefetches ahead) is chosen per CPU kind by default,
reaches the kernels, and changes no result: the kernels' own tests pass with the choice this
machine does not make by default, in a child process (the kernels take it once, as they load)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.engine import cpu_kernels as kernels_module
from pdserve.engine.cpu_kernels import CPU_PREFETCH_ENV, cpu_kernels, hardware_prefetch
from tests.pdserve.engine.test_cpu_isa import KERNEL_TESTS, REPO

READ_BACK = "from pdserve.engine.cpu_kernels import cpu_kernels; print(cpu_kernels().hardware_prefetch())"


def run_with(choice: str, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {CPU_PREFETCH_ENV: choice}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize(
    ("vendor", "flags", "expected"),
    [
        ("AuthenticAMD", {"avx2", "avx512f"}, True),  # Zen 4 and later
        ("AuthenticAMD", {"avx2"}, False),  # Zen 3
        ("GenuineIntel", {"avx2", "avx512f"}, False),
        ("", set(), False),
    ],
)
def test_auto_leaves_the_streams_to_the_hardware_on_amd_cpus_with_avx512_only(monkeypatch, vendor, flags, expected):
    monkeypatch.delenv(CPU_PREFETCH_ENV, raising=False)
    monkeypatch.setattr(kernels_module, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(kernels_module, "cpu_flags", lambda: flags)
    assert hardware_prefetch() is expected
    monkeypatch.setenv(CPU_PREFETCH_ENV, "software")
    assert hardware_prefetch() is False
    monkeypatch.setenv(CPU_PREFETCH_ENV, "hardware")
    assert hardware_prefetch() is True


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(CPU_PREFETCH_ENV, "sometimes")
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREFETCH must be one of auto, hardware, software"):
        hardware_prefetch()


def test_the_choice_reaches_the_kernels():
    assert cpu_kernels().hardware_prefetch() is hardware_prefetch()
    for choice, expected in (("hardware", "True"), ("software", "False")):
        loaded = run_with(choice, "-c", READ_BACK)
        assert loaded.returncode == 0, loaded.stderr
        assert loaded.stdout.strip().splitlines()[-1] == expected


def test_the_kernels_tests_pass_with_the_other_choice():
    other = "software" if hardware_prefetch() else "hardware"
    result = run_with(other, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *KERNEL_TESTS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
