"""What `pip install .` puts into site-packages: the five top-level packages the design names and
`pdserve`, nothing under a generic name such as `engine`, `cluster` or `bench`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXPECTED_TOP_LEVEL = {"pdserve", "gateway", "prefill_service", "decode_service", "kvtransfer", "protos"}


def test_the_wheel_installs_only_the_named_top_level_packages(tmp_path):
    # Built from a copy of the project (what `pip install .` reads), so no build/ lands in the checkout.
    source = tmp_path / "source"
    shutil.copytree(
        REPO_ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == EXPECTED_TOP_LEVEL
    assert "pdserve/engine/llm_engine.py" in names and "pdserve/cluster_state/registry.py" in names
    assert not any(name.startswith("tests/") for name in names)
