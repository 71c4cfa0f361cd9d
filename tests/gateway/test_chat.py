"""POST /v1/chat/completions against a scripted backend."""

from __future__ import annotations

import pytest

from gateway.backend import GenerationChunk
from tests.gateway.fakes import DEFAULT_TEXT, EOS_TOKEN_ID, parse_sse, text_chunks

MESSAGES = [{"role": "user", "content": "Say hello."}]


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, **fields})


def test_non_streamed_response(client, backend, tokenizer):
    response = chat(client, max_tokens=20)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"] == f"chatcmpl-{response.headers['x-request-id']}"
    assert body["model"] == "smollm2"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": DEFAULT_TEXT},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    num_completion = len(tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False)) + 1  # + EOS
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": num_completion,
        "total_tokens": len(prompt) + num_completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    (call,) = backend.calls
    assert call.prompt_token_ids == prompt
    assert call.request_id == f"{body['id']}-0"
    assert call.params.max_tokens == 20


def test_streamed_events_follow_openai(client):
    response = chat(client, stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    first, *content, finish, done = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert all(
        e["choices"][0]["finish_reason"] is None and set(e["choices"][0]["delta"]) == {"content"} for e in content
    )
    assert "".join(e["choices"][0]["delta"]["content"] for e in content) == DEFAULT_TEXT
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert "usage" not in finish
    assert done == "[DONE]"
    assert len({e["id"] for e in events[:-1]}) == 1


def test_include_usage_adds_a_final_usage_chunk(client, tokenizer):
    events = parse_sse(chat(client, stream=True, stream_options={"include_usage": True}).text)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    num_completion = len(tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False)) + 1
    assert usage_chunk["usage"]["completion_tokens"] == num_completion
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + num_completion
    assert all("usage" not in e for e in events[:-2])


def test_split_emoji_never_streams_a_broken_character(client, backend, tokenizer):
    ids = tokenizer.encode("hi 😀😀", add_special_tokens=False)
    backend.script = [GenerationChunk([t]) for t in ids] + [GenerationChunk([EOS_TOKEN_ID], finish_reason="stop")]
    events = parse_sse(chat(client, stream=True).text)
    pieces = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert all(p and "\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "hi 😀😀"


def test_stop_string_across_tokens_ends_and_aborts(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "Sure. END OF ANSWER and more text that never shows")
    events = parse_sse(chat(client, stream=True, stop=["END OF"]).text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == "Sure. "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert backend.calls[0].stream.closed_early, "the backend stream must be closed when a stop string hits"


@pytest.mark.parametrize("stop", [None, "!", ["!", "?"]])
def test_stop_accepts_null_string_and_list(client, stop):
    expected = DEFAULT_TEXT if stop is None else "Hello there"
    assert chat(client, stop=stop).json()["choices"][0]["message"]["content"] == expected


def test_max_completion_tokens_wins_over_max_tokens(client, backend):
    assert chat(client, max_tokens=50, max_completion_tokens=7).status_code == 200
    assert backend.calls[0].params.max_tokens == 7


def test_default_max_tokens_fills_the_context(client, backend, tokenizer, settings):
    chat(client)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert backend.calls[0].params.max_tokens == settings.max_model_len - len(prompt)


def test_sampling_fields_reach_the_backend(client, backend):
    chat(client, temperature=0, top_p=0.5, top_k=5, seed=11, ignore_eos=True, stop_token_ids=[7, 8])
    params = backend.calls[0].params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0, 0.5, 5, 11)
    assert params.ignore_eos is True
    assert params.stop_token_ids == (7, 8)
    assert params.logprobs is None


def test_n_runs_concurrent_generations_and_merges_them(client, backend, tokenizer):
    backend.script = lambda prompt, params: text_chunks(tokenizer, f"answer {params.seed}")
    body = chat(client, n=2, seed=100).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["answer 100", "answer 101"]
    assert [c.request_id for c in backend.calls] == [f"{body['id']}-0", f"{body['id']}-1"]
    assert body["usage"]["completion_tokens"] == 2 * (len(tokenizer.encode("answer 100", add_special_tokens=False)) + 1)
    assert body["usage"]["prompt_tokens"] == len(backend.calls[0].prompt_token_ids)


def test_n_streamed_has_a_role_and_finish_chunk_per_choice(client, backend, tokenizer):
    backend.script = lambda prompt, params: text_chunks(tokenizer, f"answer {params.seed}")
    events = parse_sse(chat(client, n=2, seed=1, stream=True).text)[:-1]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content", "") for c in mine) == f"answer {1 + index}"


def test_logprobs_in_chat_format(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "Hi 😀", with_logprobs=True)
    body = chat(client, logprobs=True, top_logprobs=1).json()
    content = body["choices"][0]["logprobs"]["content"]
    ids = tokenizer.encode("Hi 😀", add_special_tokens=False) + [EOS_TOKEN_ID]
    assert len(content) == len(ids)
    assert b"".join(bytes(entry["bytes"]) for entry in content) == "Hi 😀<|im_end|>".encode()
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["token"] == "Hi" and first["logprob"] == -0.5
    assert {"token": ".", "logprob": -1.5, "bytes": [46]} in first["top_logprobs"]
    assert backend.calls[0].params.logprobs == 1


def test_streamed_logprobs_follow_their_text(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "Hi 😀", with_logprobs=True)
    events = parse_sse(chat(client, logprobs=True, stream=True).text)[1:-1]
    entries = [entry for e in events if e["choices"][0]["logprobs"] for entry in e["choices"][0]["logprobs"]["content"]]
    assert len(entries) == len(tokenizer.encode("Hi 😀", add_special_tokens=False)) + 1
    assert backend.calls[0].params.logprobs == 0


def test_content_parts_are_joined(client, backend, tokenizer):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    chat(client, messages=[{"role": "user", "content": parts}])
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Say\nhello."}])
    assert backend.calls[0].prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_unknown_fields_are_tolerated(client):
    assert (
        chat(client, user="u1", parallel_tool_calls=False, metadata={"a": "b"}, frequency_penalty=0).status_code == 200
    )


def test_length_finish_reason_passes_through(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "cut sho", finish_reason="length")
    choice = chat(client, max_tokens=3).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "cut sho"
