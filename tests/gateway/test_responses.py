"""SSE encoding: the text events spliced into a template are the bytes pydantic would write."""

from __future__ import annotations

import pytest

from gateway.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionChunk
from gateway.responses import TextEvents, sse_event

HEADER = {"id": "cmpl-1", "created": 1700000000, "model": "smollm2"}
TEXTS = [
    "Hello",
    " world",
    "",
    'a "quoted" \\ back\\slash',
    "line\nbreak\r\ttab",
    "\x00\x01\x1f\x7f controls",
    "café ünïcödé 漢字 🦊",
    "\u2028\u2029 separators",
    "</script> /slash",
]


def completion_chunk(index: int, text: str) -> CompletionChunk:
    return CompletionChunk(**HEADER, choices=[CompletionChoice(index=index, text=text)])


def chat_chunk(index: int, text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(**HEADER, choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text))])


@pytest.mark.parametrize("make_chunk", [completion_chunk, chat_chunk])
@pytest.mark.parametrize("index", [0, 3])
def test_text_events_match_the_models_serialization_byte_for_byte(make_chunk, index):
    events = TextEvents(make_chunk)
    for text in TEXTS:
        assert events.event(index, text) == sse_event(make_chunk(index, text)), text


def test_a_chunk_without_its_text_is_refused():
    with pytest.raises(ValueError, match="exactly once"):
        TextEvents(lambda index, text: completion_chunk(index, "constant")).event(0, "x")
