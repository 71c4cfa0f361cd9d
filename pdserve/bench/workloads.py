"""Request generators for the serving benchmark: what each simulated client sends.

A workload is a stream of conversations. A conversation's turns run one after another; the
prompt of turn i holds turns 0..i-1 and the server's replies to them (`turn_messages`).
Single-turn workloads (synthetic, shared-prefix, most JSONL files) are conversations of one turn.

  synthetic       one user message of ~input_len tokens, output fixed at output_len (both drawn
                  uniformly within +-range_ratio, as vLLM's random dataset does)
  shared-prefix   one of K system prompts of prefix_len tokens, then a distinct question
  multi-turn      num_turns user messages of ~input_len tokens each
  chat            multi-turn after one of K system prompts of prefix_len tokens (a chat
                  application: the system prompt and the earlier turns are a prefix to reuse)
  jsonl           one {"prompt": ...} or {"messages": [...]} per line, optional "max_tokens"

Prompts are built from common English words that most BPE tokenizers (SmolLM2's among them)
encode as one token each, so a prompt of n words is about n tokens; the server's
usage.prompt_tokens gives the exact count. Conversation i of a stream depends only on
(seed, tag, i), so streams are reproducible however many conversations a run draws.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "chat", "jsonl")

Message = dict[str, Any]  # {"role": ..., "content": str, or token ids for the completions endpoint}

_WORDS = tuple(
    """
    time year people way day man thing woman life child world school state family student group country problem
    hand part place case week company system program question work number night point home water room mother area
    money story fact month lot right study book eye job word business issue side kind head house service friend
    father power hour game line end member law car city community name team minute idea body information back
    parent face level office door health person art war history party result change morning reason research girl
    moment air teacher force education river garden market window table paper music letter boat road bridge stone
    light summer winter village forest island mountain field apple bread coffee tea cloud rain snow wind fire sun
    moon star ocean ship train plane clock map key box bell song dance green blue red yellow small large quiet
    bright old young early late happy calm
    """.split()
)


@dataclass(frozen=True)
class Conversation:
    """One simulated client session: the messages each turn adds, and each turn's max_tokens."""

    conversation_id: int
    turns: tuple[tuple[Message, ...], ...]
    max_tokens: tuple[int, ...]

    def __post_init__(self):
        if not self.turns or len(self.turns) != len(self.max_tokens):
            raise ValueError("a conversation needs at least one turn and one max_tokens per turn")

    @property
    def num_turns(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "synthetic"
    input_len: int = 200
    output_len: int = 64
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 512
    question_len: int = 32
    num_turns: int = 3
    dataset: Path | None = None
    seed: int = 0

    def __post_init__(self):
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose from {', '.join(WORKLOADS)}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        for name in ("input_len", "output_len", "num_prefixes", "prefix_len", "question_len", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.kind == "jsonl") != (self.dataset is not None):
            raise ValueError("the jsonl workload needs --dataset FILE, and only it takes one")


def iter_conversations(config: WorkloadConfig, tag: str = "") -> Iterator[Conversation]:
    """An endless stream of conversations (a JSONL file is cycled); `tag` names an independent stream."""
    if config.kind == "jsonl":
        records = load_jsonl(config.dataset, config.output_len)
        for index, (messages, max_tokens) in enumerate(itertools.cycle(records)):
            yield Conversation(index, (messages,), (max_tokens,))
    builders = {"synthetic": _synthetic, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn, "chat": _chat}
    builder = builders[config.kind]
    for index in itertools.count():
        yield builder(config, tag, index)


def _rng(config: WorkloadConfig, tag: str, name: str) -> random.Random:
    return random.Random(f"{config.seed}/{tag}/{name}")


def _synthetic(config: WorkloadConfig, tag: str, index: int) -> Conversation:
    rng = _rng(config, tag, str(index))
    prompt = random_words(rng, sample_length(rng, config.input_len, config.range_ratio))
    return Conversation(index, ((user(prompt),),), (sample_length(rng, config.output_len, config.range_ratio),))


def _shared_prefix(config: WorkloadConfig, tag: str, index: int) -> Conversation:
    # Each request draws one of the K prefixes at random (seeded): taking them in turn would
    # line up with a round-robin router's turns and hand it perfect cache affinity for free.
    rng = _rng(config, tag, str(index))
    prefix_index = rng.randrange(config.num_prefixes)
    system_prompt = random_words(_rng(config, tag, f"prefix{prefix_index}"), config.prefix_len)
    question = f"Question {index}: " + random_words(rng, config.question_len)
    turn = ({"role": "system", "content": system_prompt}, user(question))
    return Conversation(index, (turn,), (sample_length(rng, config.output_len, config.range_ratio),))


def _multi_turn(config: WorkloadConfig, tag: str, index: int) -> Conversation:
    rng = _rng(config, tag, str(index))
    turns = tuple(
        (user(random_words(rng, sample_length(rng, config.input_len, config.range_ratio))),)
        for _ in range(config.num_turns)
    )
    max_tokens = tuple(sample_length(rng, config.output_len, config.range_ratio) for _ in range(config.num_turns))
    return Conversation(index, turns, max_tokens)


def _chat(config: WorkloadConfig, tag: str, index: int) -> Conversation:
    prefix_index = _rng(config, tag, f"{index}/system").randrange(config.num_prefixes)
    system_prompt = random_words(_rng(config, tag, f"prefix{prefix_index}"), config.prefix_len)
    conversation = _multi_turn(config, tag, index)
    first_turn = ({"role": "system", "content": system_prompt}, *conversation.turns[0])
    return Conversation(index, (first_turn, *conversation.turns[1:]), conversation.max_tokens)


def user(content: str | list[int]) -> Message:
    return {"role": "user", "content": content}


def random_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def sample_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform over [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random dataset)."""
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def load_jsonl(path: Path, default_max_tokens: int) -> list[tuple[tuple[Message, ...], int]]:
    """(messages, max_tokens) per non-blank line; a bare "prompt" becomes one user message."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                records.append(_parse_line(line, default_max_tokens, f"{path}:{line_number}"))
    if not records:
        raise ValueError(f"{path} holds no requests: write one JSON object per line")
    return records


def _parse_line(line: str, default_max_tokens: int, where: str) -> tuple[tuple[Message, ...], int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error})") from error
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise ValueError(f'{where}: expected an object with either "prompt" or "messages"')
    max_tokens = record.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    if "prompt" in record:
        return (user(record["prompt"]),), max_tokens
    messages = record["messages"]
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    return tuple(messages), max_tokens


def turn_messages(conversation: Conversation, turn_index: int, replies: Sequence[str]) -> list[Message]:
    """What turn `turn_index` sends: every earlier turn and its reply, then this turn's messages."""
    if len(replies) < turn_index:
        raise ValueError(f"turn {turn_index} needs the replies to the {turn_index} turns before it")
    messages: list[Message] = []
    for index in range(turn_index):
        messages += conversation.turns[index]
        messages.append({"role": "assistant", "content": replies[index]})
    return messages + list(conversation.turns[turn_index])


def completion_prompt(messages: Sequence[Message]) -> str | list[int]:
    """The completions endpoint's prompt: a lone user message as it is (text or token ids), else
    the contents joined by blank lines, so that a shared prefix stays a shared prefix."""
    if len(messages) == 1:
        return messages[0]["content"]
    contents = [message["content"] for message in messages]
    if not all(isinstance(content, str) for content in contents):
        raise ValueError("token-id prompts cannot be joined with other messages; send one message per request")
    return "\n\n".join(contents)
