"""The import contract in pyproject.toml ([tool.importlinter]) holds for the real tree, and it
would catch an upward import, function-local ones included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "gateway", "prefill_service", "decode_service", "kvtransfer", "protos")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_real_tree_keeps_every_contract():
    result = lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


def test_a_function_local_upward_import_breaks_the_layers(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "kvtransfer" / "upward.py").write_text(
        "def reach_up():\n    from gateway.router import Router\n\n    return Router\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "kvtransfer.upward -> gateway.router" in result.stdout
