"""The committed stubs are what the .proto files generate, and the dependency floors cover the
runtime versions the stubs demand."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from protos.generate import PROTO_DIR, REPO_ROOT, generate

# The generating tools' version stamps, not the contract: each grpcio-tools release rewrites them
# (1.85.1 -> 1.85.4 failed a clean CI run), so they are compared as floors, below.
GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", re.M)
PROTOBUF_STAMP = re.compile(
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),"
)
PROTOBUF_COMMENT = re.compile(r"^# Protobuf Python Version: .*$", re.M)


def contract(path: Path) -> str:
    text = path.read_text()
    for stamp in (GRPC_STAMP, PROTOBUF_STAMP, PROTOBUF_COMMENT):
        text = stamp.sub("<tool version>", text)
    return text


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    generate(tmp_path)
    fresh = sorted(p.name for p in (tmp_path / "protos").iterdir())
    assert fresh, "protoc generated nothing"
    committed = sorted(p.name for p in PROTO_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")))
    assert fresh == committed
    stale = [name for name in fresh if contract(tmp_path / "protos" / name) != contract(PROTO_DIR / name)]
    assert not stale, f"stale stubs, run `python -m protos.generate`: {stale}"


def test_the_dependency_floors_cover_the_stubs_runtime_checks():
    """Each stub refuses to import under an older grpcio or protobuf than generated it: the
    project's (and the gateway image's) lowest allowed versions must pass those checks."""
    stubs = [p.read_text() for p in sorted(PROTO_DIR.glob("*_pb2*.py"))]
    grpc_needs = max(Version(m) for text in stubs for m in GRPC_STAMP.findall(text))
    protobuf_needs = max(Version(".".join(m)) for text in stubs for m in PROTOBUF_STAMP.findall(text))
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    gateway_image = (REPO_ROOT / "deploy/gateway-requirements.txt").read_text().splitlines()
    for requirements in (project, [line for line in gateway_image if line and not line.startswith("#")]):
        floors = {
            r.name: min(Version(s.version) for s in r.specifier)
            for r in map(Requirement, requirements)
            if r.name in ("grpcio", "protobuf")
        }
        assert floors["grpcio"] >= grpc_needs and floors["protobuf"] >= protobuf_needs


def test_stubs_import_from_the_repo_root():
    from protos import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, prefill_pb2  # noqa: F401

    assert decode_pb2.GenerateResponse.DESCRIPTOR.full_name == "pdserve.v1.GenerateResponse"
