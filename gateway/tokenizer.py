"""The model's tokenizer and chat template, without transformers: the gateway image has no torch.

Encodings come from the `tokenizers` library (the same Rust code transformers runs); the chat
template is rendered with jinja2 in the environment transformers uses (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, special tokens as variables), so prompts match token for token.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template. Immutable after construction."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: tuple[int, ...],
        byte_level: bool,
    ) -> None:
        self.backend = backend  # the tokenizers.Tokenizer (incremental decoding needs it)
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._byte_level = byte_level
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """Loads tokenizer.json, tokenizer_config.json, the chat template and generation_config.json."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise ValueError(f"{folder} has no tokenizer.json: save the model's tokenizer with transformers first")
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_tokens = {key: _token_content(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key)}
        # The decoder's pickled state is its JSON config: cheaper than serializing the whole tokenizer.
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
        return cls(
            backend=backend,
            special_tokens=special_tokens,
            chat_template=_read_chat_template(folder, config),
            eos_token_ids=_eos_token_ids(backend, special_tokens, _read_json(folder / "generation_config.json")),
            byte_level=_has_byte_level_decoder(decoder),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation; encode it with add_special_tokens=False (the template
        writes its own special tokens). Raises ValueError when the template rejects the messages."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: use /v1/completions with a plain prompt")
        # transformers drops keys whose value is None (e.g. an assistant message's content beside tool_calls).
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (possibly part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if token_id in self._added_token_ids:
            return piece.encode()  # added tokens are stored as plain text
        if self._byte_level:
            return bytes(_unicode_to_byte()[char] for char in piece)
        # SentencePiece-style: "▁" is a space, "<0xNN>" a raw byte.
        if match := _BYTE_FALLBACK_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs; a partial UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(value: str | dict[str, Any]) -> str:
    # Older tokenizer_config.json files store special tokens as serialized AddedToken objects.
    return value["content"] if isinstance(value, dict) else value


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _eos_token_ids(
    backend: tokenizers.Tokenizer, special_tokens: dict[str, str], generation_config: dict
) -> tuple[int, ...]:
    ids = generation_config.get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if "eos_token" in special_tokens and (eos_id := backend.token_to_id(special_tokens["eos_token"])) is not None:
        ids.append(eos_id)
    return tuple(dict.fromkeys(ids))


def _has_byte_level_decoder(decoder: dict[str, Any]) -> bool:
    if decoder.get("type") == "Sequence":
        return any(_has_byte_level_decoder(part) for part in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table that byte-level BPE vocabularies use."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_values, code_points = printable[:], printable[:]
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            code_points.append(256 + len(code_points) - len(printable))
    return {chr(code_point): byte for byte, code_point in zip(byte_values, code_points)}


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by training templates) and renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON (as in transformers).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Templates are untrusted code from the model folder: sandboxed, like transformers does."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
