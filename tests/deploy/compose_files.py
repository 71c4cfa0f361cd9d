"""Reads docker-compose.yml as docker compose would with the defaults: `${VAR:-default}` becomes
the default, `${VAR:?message}` (a required setting) a placeholder, anchors and `<<` merged."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED_PLACEHOLDER = "set-in-dot-env"
_VARIABLE = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def interpolate(text: str) -> str:
    def value(match: re.Match) -> str:
        kind, rest = match.group(2), match.group(3)
        return REQUIRED_PLACEHOLDER if kind == "?" else (rest or "")

    return _VARIABLE.sub(value, text)


def load_compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load(interpolate((REPO_ROOT / name).read_text()))


def required_variables(name: str = "docker-compose.yml") -> set[str]:
    return {m.group(1) for m in _VARIABLE.finditer((REPO_ROOT / name).read_text()) if m.group(2) == "?"}
