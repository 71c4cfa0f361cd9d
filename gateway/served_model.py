"""What the gateway serves: the model's names, context length and tokenizer, loaded once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gateway.settings import GatewaySettings
from gateway.tokenizer import Tokenizer
from pdserve.engine.model_loader import resolve_model


@dataclass(frozen=True)
class ServedModel:
    name: str  # reported in responses and /v1/models
    accepted_names: frozenset[str]  # what a request's "model" may say
    path: Path
    max_model_len: int
    tokenizer: Tokenizer

    def check_name(self, requested: str | None) -> None:
        """Raises ValueError for a model this gateway does not serve (None means "the one you have")."""
        if requested is not None and requested not in self.accepted_names:
            raise ValueError(f"the model {requested!r} does not exist; this gateway serves {self.name!r}")


def load_served_model(settings: GatewaySettings) -> ServedModel:
    resolved = resolve_model(settings.model)
    config = json.loads((resolved.path / "config.json").read_text())
    max_model_len = settings.max_model_len or config.get("max_position_embeddings")
    if not max_model_len:
        raise ValueError(f"{resolved.path}/config.json has no max_position_embeddings: set max_model_len")
    name = settings.served_model_name or resolved.served_name
    return ServedModel(
        name=name,
        accepted_names=frozenset({name, resolved.served_name, settings.model}),
        path=resolved.path,
        max_model_len=max_model_len,
        tokenizer=Tokenizer.from_folder(resolved.path),
    )
