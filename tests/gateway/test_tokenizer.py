"""The torch-free tokenizer must encode, decode and render chat templates exactly as transformers."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from gateway.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines  ",
    "Emoji 😀👍🏽 and CJK 你好, accents ünïcödé",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
]


@pytest.fixture(scope="module")
def reference(default_model_path):
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(tokenizer, reference, text, add_special_tokens):
    expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(tokenizer, reference, text, skip_special_tokens):
    ids = reference(text)["input_ids"]
    expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tokenizer, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    expected_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert tokenizer.encode(rendered, add_special_tokens=False) == list(expected_ids)


def test_special_tokens_vocab_and_eos(tokenizer, reference):
    assert tokenizer.eos_token_ids == (reference.eos_token_id,)
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.special_tokens["bos_token"] == reference.bos_token


def test_token_bytes_concatenate_to_the_text(tokenizer):
    text = "Emoji 😀 splits into byte tokens: 你好"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert any(len(p) and not _is_utf8(p) for p in pieces), "expected a token holding part of a character"
    assert tokenizer.token_text(2) == "<|im_end|>"


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


def _folder_with_template(tmp_path, default_model_path, template: str):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((default_model_path / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template  # the older place for it, without chat_template.jinja
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_folder(tmp_path)


def test_template_environment_matches_transformers(tmp_path, default_model_path, reference):
    """raise_exception, tojson without HTML escaping, special tokens, {% generation %}, loop controls,
    trim_blocks / lstrip_blocks: rendered as transformers renders the same template."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
    )
    tokenizer = _folder_with_template(tmp_path, default_model_path, template)
    messages = [{"role": "user", "content": "<b>&"}] * 3
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered == reference.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert rendered.count('"<b>&"') == 2
    with pytest.raises(ValueError, match="no tools"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_without_a_template_chat_is_refused(tmp_path, default_model_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((default_model_path / name).read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
