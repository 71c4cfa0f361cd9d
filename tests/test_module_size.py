"""No module grows past 400 lines (STYLE.md: split a module by concern before it does);
generated gRPC stubs excepted."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
SOURCE_DIRS = ("pdserve", "gateway", "prefill_service", "decode_service", "kvtransfer", "protos", "tests")


def test_every_module_is_at_most_400_lines():
    too_long = {
        str(path.relative_to(REPO_ROOT)): num_lines
        for folder in SOURCE_DIRS
        for path in (REPO_ROOT / folder).rglob("*.py")
        if "_pb2" not in path.name and (num_lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}
