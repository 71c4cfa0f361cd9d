"""The committed stubs are exactly what the .proto files generate."""

from __future__ import annotations

import filecmp

from protos.generate import PROTO_DIR, generate


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    generate(tmp_path)
    fresh = sorted(p.name for p in (tmp_path / "protos").iterdir())
    assert fresh, "protoc generated nothing"
    committed = sorted(p.name for p in PROTO_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")))
    assert fresh == committed
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "protos", PROTO_DIR, fresh, shallow=False)
    assert not mismatch and not errors, f"stale stubs, run `python -m protos.generate`: {mismatch + errors}"


def test_stubs_import_from_the_repo_root():
    from protos import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, prefill_pb2  # noqa: F401

    assert decode_pb2.GenerateResponse.DESCRIPTOR.full_name == "pdserve.v1.GenerateResponse"
