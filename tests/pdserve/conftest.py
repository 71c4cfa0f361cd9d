"""Fixtures for the launcher's tests: `fakes` makes a command_for that runs the fake children of
tests/pdserve/launcher_fakes.py instead of `python -m pdserve.cli`."""

from __future__ import annotations

import os
import sys

import pytest

from pdserve.launch_plan import ChildSpec, default_command
from tests.pdserve.launcher_fakes import FAKE_GATEWAY, FAKE_NODE, REPO_ROOT


@pytest.fixture
def fakes(tmp_path, importable_repo):
    """command_for that runs the fake scripts instead of `python -m pdserve.cli`, with overrides per child name."""
    (tmp_path / "fake_node.py").write_text(FAKE_NODE)
    (tmp_path / "fake_gateway.py").write_text(FAKE_GATEWAY)

    def make(overrides: dict[str, str] | None = None):
        def command_for(spec: ChildSpec) -> list[str]:
            if overrides and spec.name in overrides:
                return [sys.executable, "-c", overrides[spec.name]]
            script = tmp_path / ("fake_node.py" if spec.is_node else "fake_gateway.py")
            return [sys.executable, str(script)] + default_command(spec)[3:]  # drop "python -m pdserve.cli"

        return command_for

    return make


@pytest.fixture
def importable_repo(monkeypatch):
    # The fake scripts import pdserve.cluster_state.registry; children inherit this environment.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
