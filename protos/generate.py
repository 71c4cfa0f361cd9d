"""Regenerates the committed gRPC stubs: run `python -m protos.generate` from the repo root.

Generated from the repo root so that imports read `from protos import common_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent


def generate(out_dir: Path = REPO_ROOT) -> None:
    protos = sorted(str(p.relative_to(REPO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
