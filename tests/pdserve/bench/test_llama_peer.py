"""The llama.cpp peer's GGUF files (pdserve/bench/llama_peer.py): an F16 copy of the packaged Q4_1
file keeps every metadata field and tensor, holds the dequantized values, and stores 2-D weights
as float16 and norms as float32, as llama.cpp expects."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pdserve.bench.llama_peer import gguf_files, packaged_gguf

pytestmark = pytest.mark.timeout(300)


def test_an_f16_copy_of_the_packaged_gguf_holds_its_dequantized_tensors(tmp_path):
    files = gguf_files("smollm2-135m", tmp_path, ("F16", "Q4_1"))
    assert files["Q4_1"] == packaged_gguf("smollm2-135m")  # used as is
    source, copy = gguf.GGUFReader(files["Q4_1"]), gguf.GGUFReader(files["F16"])
    assert set(source.fields) == set(copy.fields)
    assert int(copy.fields[gguf.Keys.General.FILE_TYPE].contents()) == gguf.LlamaFileType.MOSTLY_F16
    assert copy.fields["tokenizer.ggml.tokens"].contents() == source.fields["tokenizer.ggml.tokens"].contents()
    tensors = {t.name: t for t in copy.tensors}
    assert set(tensors) == {t.name for t in source.tensors}
    for original in source.tensors:
        if original.name not in ("blk.0.attn_q.weight", "blk.0.attn_norm.weight", "token_embd.weight"):
            continue
        converted = tensors[original.name]
        expected = gguf.quants.dequantize(original.data, original.tensor_type)
        wanted_type = gguf.GGMLQuantizationType.F16 if expected.ndim == 2 else gguf.GGMLQuantizationType.F32
        assert converted.tensor_type == wanted_type
        np.testing.assert_allclose(np.asarray(converted.data, dtype=np.float32), expected, rtol=1e-3, atol=1e-4)


def test_only_packaged_models_have_a_gguf_to_convert():
    with pytest.raises(ValueError, match="packaged GGUF model"):
        packaged_gguf("/some/folder")
