"""Incremental detokenization: UTF-8 safe, equal to the full decode, stop strings held back and cut."""

from __future__ import annotations

import pytest

from gateway.detokenizer import Detokenizer

EOS = 2


def feed(detokenizer: Detokenizer, token_ids: list[int], per_step: int = 1) -> list[str]:
    """Every piece released, one step per `per_step` tokens, then the finish."""
    pieces = [detokenizer.add_tokens(token_ids[i : i + per_step]) for i in range(0, len(token_ids), per_step)]
    return pieces + [detokenizer.finish()]


@pytest.mark.parametrize("per_step", [1, 2, 5])
@pytest.mark.parametrize("text", ["Hello world", "Emoji 😀👍🏽 split, CJK 你好, ünïcödé", "a\n\n  b\tc"])
def test_pieces_concatenate_to_the_full_decode(tokenizer, text, per_step):
    ids = tokenizer.encode(text, add_special_tokens=False) + [EOS]
    pieces = feed(Detokenizer(tokenizer), ids, per_step)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_split_emoji_is_held_until_complete(tokenizer):
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2, "the emoji's bytes span two tokens in this vocabulary"
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.add_tokens(ids[:1]) == ""
    assert detokenizer.add_tokens(ids[1:]) == " 😀"


def test_bytes_that_never_complete_are_flushed_at_finish(tokenizer):
    first_half = tokenizer.encode(" 😀", add_special_tokens=False)[:1]
    ids = tokenizer.encode("ok", add_special_tokens=False) + first_half
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.add_tokens(ids) == "ok"
    assert detokenizer.finish() == tokenizer.decode(ids)[2:] == " \ufffd"


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert "".join(feed(Detokenizer(tokenizer), ids)) == "hi"


def test_stop_string_across_tokens_cuts_before_it(tokenizer):
    text = "The answer is 42.\nUser: next question"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, stop=["\nUser:"])
    pieces = [detokenizer.add_tokens([t]) for t in ids]
    assert detokenizer.stopped
    assert "".join(pieces) == detokenizer.text == "The answer is 42."
    assert detokenizer.finish() == ""
    assert not any("\n" in piece for piece in pieces), "a possible stop prefix leaked out"


def test_a_possible_stop_prefix_is_held_then_released(tokenizer):
    detokenizer = Detokenizer(tokenizer, stop=["STOP!"])
    assert detokenizer.add_tokens(tokenizer.encode("go ST", add_special_tokens=False)) == "go "
    assert detokenizer.add_tokens(tokenizer.encode("OP", add_special_tokens=False)) == ""
    assert detokenizer.add_tokens(tokenizer.encode(" now", add_special_tokens=False)) == "STOP now"
    assert not detokenizer.stopped


def test_held_prefix_is_released_at_finish(tokenizer):
    detokenizer = Detokenizer(tokenizer, stop=["STOP"])
    assert detokenizer.add_tokens(tokenizer.encode("end ST", add_special_tokens=False)) == "end "
    assert detokenizer.finish() == "ST"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, stop=["three", "two"])
    assert "".join(feed(detokenizer, ids, per_step=len(ids))) == "one "
    assert detokenizer.stopped


def test_stop_string_at_the_start_releases_nothing(tokenizer):
    ids = tokenizer.encode("Stop right there", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, stop=["Stop"])
    assert "".join(feed(detokenizer, ids)) == ""
    assert detokenizer.stopped


def test_stop_string_completed_by_the_last_token_at_finish(tokenizer):
    ids = tokenizer.encode("abc END", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, stop=[" END"])
    assert "".join(feed(detokenizer, ids)) == "abc"
    assert detokenizer.stopped


def test_empty_stop_string_is_refused(tokenizer):
    with pytest.raises(ValueError, match="empty"):
        Detokenizer(tokenizer, stop=[""])


def test_a_chunk_running_past_a_stop_string_uses_the_tokens_up_to_it(tokenizer):
    before = tokenizer.encode("The answer is 42.", add_special_tokens=False)
    stop = tokenizer.encode("\nUser:", add_special_tokens=False)
    after = tokenizer.encode(" next question", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, stop=["\nUser:"])
    text, num_used = detokenizer.add_tokens_until_stop(before + stop + after)
    assert (text, num_used) == ("The answer is 42.", len(before) + len(stop))
    assert detokenizer.stopped


def test_a_chunk_without_stop_strings_is_used_whole(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert Detokenizer(tokenizer).add_tokens_until_stop(ids) == ("Hello world", len(ids))
