"""The serving benchmark's workloads: shapes, sharing, growth, parsing and seeded determinism."""

from __future__ import annotations

import json
from itertools import islice, pairwise

import pytest

from pdserve.bench.workloads import WorkloadConfig, completion_prompt, iter_conversations, turn_messages


def take(config: WorkloadConfig, count: int, tag: str = "t"):
    return list(islice(iter_conversations(config, tag), count))


def test_synthetic_lengths_are_fixed_without_a_range_ratio():
    conversations = take(WorkloadConfig(input_len=50, output_len=7), 5)
    assert [c.conversation_id for c in conversations] == [0, 1, 2, 3, 4]
    for conversation in conversations:
        (messages,) = conversation.turns
        assert [m["role"] for m in messages] == ["user"]
        assert len(messages[0]["content"].split()) == 50
        assert conversation.max_tokens == (7,)
    assert len({c.turns[0][0]["content"] for c in conversations}) == 5


def test_synthetic_lengths_spread_uniformly_within_the_range_ratio():
    conversations = take(WorkloadConfig(input_len=100, output_len=20, range_ratio=0.5), 200)
    input_lens = [len(c.turns[0][0]["content"].split()) for c in conversations]
    output_lens = [c.max_tokens[0] for c in conversations]
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and len(set(input_lens)) > 30
    assert min(output_lens) >= 10 and max(output_lens) <= 30 and len(set(output_lens)) > 10


def test_streams_are_seeded_by_seed_tag_and_index():
    config = WorkloadConfig(input_len=20, range_ratio=0.3)
    first = take(config, 4)
    assert take(config, 4) == first
    assert take(config, 9)[:4] == first  # conversation i does not depend on how many are drawn
    assert take(config, 4, tag="other") != first
    assert take(WorkloadConfig(input_len=20, range_ratio=0.3, seed=1), 4) != first


def test_shared_prefix_requests_share_their_system_prompt_and_differ_after_it():
    config = WorkloadConfig(kind="shared-prefix", num_prefixes=3, prefix_len=40, question_len=6, output_len=5)
    conversations = take(config, 30)
    assert conversations == take(config, 30)  # seeded
    system_prompts = [c.turns[0][0]["content"] for c in conversations]
    questions = [c.turns[0][1]["content"] for c in conversations]
    assert [c.turns[0][0]["role"] for c in conversations] == ["system"] * 30
    assert all(len(prompt.split()) == 40 for prompt in system_prompts)
    assert len(set(system_prompts)) == 3  # every prefix drawn, each by several requests
    assert len(set(questions)) == 30
    # Through the completions endpoint the system prompt is a prefix of the whole prompt.
    first, same = 0, system_prompts.index(system_prompts[0], 1)
    prompts = [completion_prompt(turn_messages(c, 0, [])) for c in conversations]
    assert prompts[first].startswith(system_prompts[0] + "\n\n") and prompts[same].startswith(
        system_prompts[0] + "\n\n"
    )
    assert prompts[first] != prompts[same]


def test_multi_turn_prompts_grow_and_hold_every_earlier_turn_and_reply():
    config = WorkloadConfig(kind="multi-turn", num_turns=3, input_len=10, output_len=4)
    (conversation,) = take(config, 1)
    assert conversation.num_turns == 3 and conversation.max_tokens == (4, 4, 4)
    replies = ["first reply", "second reply"]
    turns = [turn_messages(conversation, i, replies[:i]) for i in range(3)]
    assert [len(messages) for messages in turns] == [1, 3, 5]
    assert [m["role"] for m in turns[2]] == ["user", "assistant", "user", "assistant", "user"]
    for earlier, later in pairwise(turns):
        assert later[: len(earlier)] == earlier
    assert turns[2][1]["content"] == "first reply" and turns[2][3]["content"] == "second reply"
    assert len({m["content"] for m in turns[2] if m["role"] == "user"}) == 3
    prompts = [completion_prompt(messages) for messages in turns]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])


def test_a_turn_needs_the_replies_before_it():
    (conversation,) = take(WorkloadConfig(kind="multi-turn", num_turns=2), 1)
    with pytest.raises(ValueError, match="replies"):
        turn_messages(conversation, 1, [])


def test_jsonl_prompts_messages_and_max_tokens(tmp_path):
    dataset = tmp_path / "requests.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    lines = [{"prompt": "Once upon a time"}, {"messages": messages, "max_tokens": 5}, {"prompt": [1, 2, 3]}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    conversations = take(WorkloadConfig(kind="jsonl", dataset=dataset, output_len=9), 4)
    assert conversations[0].turns == (({"role": "user", "content": "Once upon a time"},),)
    assert conversations[0].max_tokens == (9,)
    assert conversations[1].turns == (tuple(messages),) and conversations[1].max_tokens == (5,)
    assert completion_prompt(turn_messages(conversations[2], 0, [])) == [1, 2, 3]
    # The file is cycled when a run needs more requests than it holds.
    assert conversations[3].turns == conversations[0].turns and conversations[3].conversation_id == 3


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "requests.jsonl:2: not JSON"),
        ('{"text": "x"}', 'either "prompt" or "messages"'),
        ('{"prompt": "x", "messages": []}', 'either "prompt" or "messages"'),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be a positive integer"),
        ('{"messages": [{"content": "x"}]}', '"messages" must be a non-empty list'),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    dataset = tmp_path / "requests.jsonl"
    dataset.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        take(WorkloadConfig(kind="jsonl", dataset=dataset), 1)


def test_token_ids_cannot_be_joined_with_other_messages():
    with pytest.raises(ValueError, match="token-id"):
        completion_prompt([{"role": "system", "content": "x"}, {"role": "user", "content": [1, 2]}])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"kind": "sharegpt"}, "unknown workload"),
        ({"range_ratio": 1.0}, "range_ratio"),
        ({"input_len": 0}, "input_len"),
        ({"kind": "jsonl"}, "--dataset"),
    ],
)
def test_bad_configs_say_how_to_fix_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**overrides)


def test_chat_conversations_share_system_prompts_and_then_take_turns():
    config = WorkloadConfig(kind="chat", num_prefixes=2, prefix_len=20, num_turns=3, input_len=5, output_len=4)
    conversations = take(config, 12)
    system_prompts = {c.turns[0][0]["content"] for c in conversations}
    assert len(system_prompts) == 2  # every conversation starts with one of the K shared prompts
    for conversation in conversations:
        assert conversation.num_turns == 3 and conversation.max_tokens == (4, 4, 4)
        assert conversation.turns[0][0]["role"] == "system" and len(conversation.turns[0][0]["content"].split()) == 20
        assert [m["role"] for turn in conversation.turns[1:] for m in turn] == ["user", "user"]
