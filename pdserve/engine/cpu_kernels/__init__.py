"""C++ kernels for the CPU, compiled on first use for the CPU they run on.

torch.utils.cpp_extension builds each source with gcc (-O3 -march=native) into
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR); the module name carries a hash of the source
and of this CPU's feature flags, so a cache shared by different machines (an image built on
one host and run on another) never loads code built for instructions this CPU lacks. The
first build takes about a minute on 2 cores; later loads take milliseconds.

torch guards a build folder with a `lock` file that a killed build leaves behind, and every
later load then waits on it forever (a Ctrl-C during the first `pdserve up` hung each start after
it). So processes take turns with an flock, which the kernel drops when its holder dies, and
the one holding it removes any `lock` file: no live process can own it.

`PDSERVE_CPU_ISA=avx2` builds for AVX2 and FMA only (-march=haswell), whatever the CPU has, and
turns off the bfloat16 prefill path (quantization.py): the code an AVX2-only machine (many AMD
EPYC hosts) runs, for testing and measuring it on an AVX-512 one. With torch's own kernels held to
AVX2 as well (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2), only the memory system and the
clock are this machine's.

`PDSERVE_CPU_PREFETCH=hardware|software` chooses how batch-1 int8 GEMVs stream their weights:
left to the CPU's own prefetchers, or with software prefetches ahead of the rows (kernels.h). The
default, auto, is hardware on AMD CPUs with AVX-512 (Zen 4 and later) and software elsewhere,
Zen 3 included, each where it measured faster; the choice changes no result, only how fast the
weights arrive.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_ISA_ENV = "PDSERVE_CPU_ISA"
ISA_TO_MARCH = {"native": "-march=native", "avx2": "-march=haswell"}


def cpu_isa() -> str:
    """The instruction set the kernels are built for: `native` (default) or `avx2`."""
    isa = os.environ.get(CPU_ISA_ENV, "native")
    if isa not in ISA_TO_MARCH:
        raise ValueError(f"{CPU_ISA_ENV} must be one of {', '.join(ISA_TO_MARCH)}, got {isa!r}")
    return isa


CPU_PREFETCH_ENV = "PDSERVE_CPU_PREFETCH"
PREFETCH_CHOICES = ("auto", "hardware", "software")


def hardware_prefetch() -> bool:
    """Whether batch-1 weight streams are left to the hardware prefetchers (PDSERVE_CPU_PREFETCH)."""
    choice = os.environ.get(CPU_PREFETCH_ENV, "auto")
    if choice not in PREFETCH_CHOICES:
        raise ValueError(f"{CPU_PREFETCH_ENV} must be one of {', '.join(PREFETCH_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice == "hardware"
    # AVX-512 marks AMD's Zen 4 and later, whose prefetchers kept up alone (docs/benchmarks.md,
    # "twenty-first pass"); on a Zen 3 (AVX2) the software prefetch made int8 batch-1 steps
    # 0.93x as long, alternating in one engine ("twenty-fifth pass").
    return cpu_vendor() == "AuthenticAMD" and "avx512f" in cpu_flags()


def compile_flags() -> list[str]:
    # -fopenmp: at::parallel_for is OpenMP in torch's CPU build, and without it runs on one thread.
    # 512-bit vectors where the CPU has them: the int8 -> float conversions bound these loops.
    # -fno-trapping-math (clang's default; no result changes): under gcc's default, vector_exp's
    # clamp kept every loop that calls it scalar ("control flow in loop"), and silu_and_mul over a
    # 210-token prefill's [210, 2 x 1536] took 0.94 ms a layer instead of 0.15 (AMD EPYC Zen 3).
    return ["-O3", ISA_TO_MARCH[cpu_isa()], "-fopenmp", "-mprefer-vector-width=512", "-fno-trapping-math"]


SOURCES = (
    "dense_gemv.cpp",
    "quantized_gemv.cpp",
    "int8_panels.cpp",
    "bfloat16_prefill.cpp",
    "int4_panels.cpp",
    "int4_byte_inputs.cpp",
    "paged_attention.cpp",
    "decode_stack.cpp",
    "batch1_step.cpp",
    "bindings.cpp",
)
HEADERS = ("kernels.h", "decode_stack.h")  # compiled only through the sources, but a change to it must rebuild


@functools.cache
def cpu_kernels():
    """int8_linear, int4_linear (quantized_gemv.cpp), int8_bfloat16_linear (bfloat16_prefill.cpp),
    paged_decode_attention (paged_attention.cpp), and the Linear and DecodeStack classes
    (decode_stack.cpp)."""
    from torch.utils.cpp_extension import get_default_build_root, load

    sources = [Path(__file__).with_name(name) for name in SOURCES]
    headers = [Path(__file__).with_name(name) for name in HEADERS]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*sources, *headers)))
    flags = compile_flags()
    digest.update(" ".join(flags).encode() + _cpuinfo_field("flags").encode())
    name = f"pdserve_cpu_kernels_{digest.hexdigest()[:12]}"
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    logger.info("loading pdserve's CPU kernels (compiled once per machine, about a minute)")
    with exclusive_build(build_dir):
        module = load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    module.set_hardware_prefetch(hardware_prefetch())
    return module


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Holds `build_dir`'s flock (waiting for another process's build to end) and clears
    torch's `lock` file, which only a dead build can have left while the flock is ours."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pdserve.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        stale_lock = build_dir / "lock"
        if stale_lock.exists():
            logger.warning("removing %s, left by a build that was killed", stale_lock)
            stale_lock.unlink()
        yield


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id: AuthenticAMD, GenuineIntel, ... ("" where there is none)."""
    return _cpuinfo_field("vendor_id").partition(":")[2].strip()


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's feature flags (avx2, avx512f, ...)."""
    return set(_cpuinfo_field("flags").partition(":")[2].split())


def _cpuinfo_field(name: str) -> str:
    """The first line of /proc/cpuinfo that starts with `name` ("" without one)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in cpuinfo.splitlines() if line.startswith(name)), "")
