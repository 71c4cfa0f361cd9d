from __future__ import annotations

import pytest

from pdserve.engine.model_loader import MODEL_ALIASES, resolve_model


def test_hugging_face_folder_is_used_as_is(tiny_llama_path):
    resolved = resolve_model(str(tiny_llama_path))
    assert resolved.path == tiny_llama_path


def test_unknown_model_says_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="alias"):
        resolve_model(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_gguf_file_is_converted_once(tmp_path):
    """A .gguf path converts to a cached safetensors folder; the second call reuses it."""
    gguf = MODEL_ALIASES["smollm2-135m"].gguf_path()
    first = resolve_model(str(gguf), cache_dir=tmp_path)
    assert (first.path / "model.safetensors").exists()
    mtime = (first.path / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(str(gguf), cache_dir=tmp_path)
    assert second.path == first.path
    assert (second.path / "model.safetensors").stat().st_mtime_ns == mtime
