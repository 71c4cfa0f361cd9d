"""C++ kernels for the CPU, compiled on first use for the CPU they run on.

torch.utils.cpp_extension builds each source with gcc (-O3 -march=native) into
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR); the module name carries a hash of the source
and of this CPU's feature flags, so a cache shared by different machines (an image built on
one host and run on another) never loads code built for instructions this CPU lacks. The
first build takes about a minute on 2 cores; later loads take milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# -fopenmp: at::parallel_for is OpenMP in torch's CPU build, and without it runs on one thread.
# 512-bit vectors where the CPU has them: the int8 -> float conversions bound these loops.
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-mprefer-vector-width=512"]


@functools.cache
def quantized_gemv():
    """int8_linear(x, q, scale) and int4_linear(x, packed, scale, low): see quantized_gemv.cpp."""
    return _load("quantized_gemv")


def _load(name: str):
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name(f"{name}.cpp")
    tag = hashlib.sha256(source.read_bytes() + " ".join(COMPILE_FLAGS).encode() + _cpu_flags()).hexdigest()[:12]
    logger.info("loading the %s CPU kernels (compiled once per machine, about a minute)", name)
    return load(
        name=f"pdserve_{name}_{tag}",
        sources=[str(source)],
        extra_cflags=COMPILE_FLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def _cpu_flags() -> bytes:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "").encode()
