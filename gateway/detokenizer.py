"""Incremental detokenization with stop strings, for one generated sequence.

    decoded:  "The answer is 42.\\nUser"        stop = ["\\nUser:"]
                               ^emitted ^held back: "\\nUser" may still become the stop string

Text is released only when it is final: never inside a multi-byte character (the decode stream
holds tokens back until their bytes form whole characters), never part of a stop string, never
a suffix that may grow into one. When a stop string appears, the text before it is released and
the rest of the sequence is dropped. `finish()` releases the rest, so the concatenated output
equals the full decode of the tokens (cut before the stop string, if one hit).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from gateway.tokenizer import Tokenizer


class Detokenizer:
    """Feeds token ids in, takes final text out. Mutates only itself."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self._text = ""  # decoded so far, whole characters only
        self._num_released = 0  # characters of _text already returned
        self.stopped = False  # a stop string was found; nothing more is released

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._num_released]

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the newly final text (maybe empty)."""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            if self.stopped:
                continue
            piece = self._stream.step(self._tokenizer.backend, token_id)
            if piece:  # None while the token ends inside a multi-byte character
                self._text += piece
        return self._release(final=False)

    def add_tokens_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Like `add_tokens`, for a chunk of several tokens that may run past a stop string: feeds
        them up to the one that completes it. Returns the new final text and how many of the
        tokens belong to the output (those past the stop do not)."""
        if not self._stop:
            return self.add_tokens(token_ids), len(token_ids)
        text = ""
        for num_used, token_id in enumerate(token_ids, start=1):
            text += self.add_tokens((token_id,))
            if self.stopped:
                return text, num_used
        return text, len(token_ids)

    def finish(self) -> str:
        """The sequence ended: returns the rest, including bytes that never formed a whole character."""
        if self.stopped:
            return ""
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special_tokens)
        # The stream's pieces are a prefix of the full decode; the difference is what it still held back.
        if full.startswith(self._text):
            self._text = full
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        stop_at = self._find_stop()
        if stop_at is not None:
            self.stopped = True
            end = stop_at
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._partial_stop_length()
        released = self._text[self._num_released : end]
        self._num_released = max(self._num_released, end)
        return released

    def _find_stop(self) -> int | None:
        """Where the earliest stop string starts. Held-back text means none can start before the
        released part ends, so only the unreleased tail is searched."""
        starts = [i for s in self._stop if (i := self._text.find(s, self._num_released)) >= 0]
        return min(starts) if starts else None

    def _partial_stop_length(self) -> int:
        """The longest unreleased suffix that is the beginning of some stop string."""
        tail = self._text[self._num_released :]
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:length]):
                    longest = length
                    break
        return longest
