"""POST /v1/completions against a scripted backend."""

from __future__ import annotations

from gateway.routes.completions import DEFAULT_MAX_TOKENS
from tests.gateway.fakes import DEFAULT_TEXT, parse_sse, text_chunks


def complete(client, **fields):
    return client.post("/v1/completions", json={"model": "smollm2", "prompt": "Once upon a time", **fields})


def test_non_streamed_response(client, backend, tokenizer):
    response = complete(client)
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"] == f"cmpl-{response.headers['x-request-id']}"
    assert body["choices"] == [{"index": 0, "text": DEFAULT_TEXT, "logprobs": None, "finish_reason": "stop"}]
    prompt = tokenizer.encode("Once upon a time")
    assert backend.calls[0].prompt_token_ids == prompt
    assert backend.calls[0].params.max_tokens == DEFAULT_MAX_TOKENS
    num_completion = len(tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False)) + 1
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == num_completion
    assert body["usage"]["total_tokens"] == len(prompt) + num_completion


def test_streamed_events_then_finish_usage_and_done(client, tokenizer):
    events = parse_sse(complete(client, stream=True, stream_options={"include_usage": True}).text)
    *content, finish, usage, done = events
    assert all(e["object"] == "text_completion" and e["choices"][0]["finish_reason"] is None for e in content)
    assert "".join(e["choices"][0]["text"] for e in content) == DEFAULT_TEXT
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(text_chunks(tokenizer, DEFAULT_TEXT))
    assert done == "[DONE]"


def test_stop_string_across_token_boundaries(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "first line\n\nsecond line", tokens_per_chunk=2)
    body = complete(client, stop="\n\n").json()
    assert body["choices"][0]["text"] == "first line"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert backend.calls[0].stream.closed_early


def test_a_chunk_running_past_a_stop_string_counts_and_scores_only_the_tokens_up_to_it(client, backend, tokenizer):
    # A node with --stream-interval sends several tokens per chunk: here the stop string ends
    # inside the first chunk, whose last tokens are not part of the completion.
    backend.script = text_chunks(tokenizer, "one two. three four", tokens_per_chunk=8, with_logprobs=True)
    body = complete(client, stop=".", logprobs=0).json()
    used = len(tokenizer.encode("one two.", add_special_tokens=False))
    assert body["choices"][0]["text"] == "one two"
    assert body["usage"]["completion_tokens"] == used
    assert len(body["choices"][0]["logprobs"]["tokens"]) == used


def test_token_id_prompts_and_prompt_lists(client, backend, tokenizer):
    ids = tokenizer.encode("abc")
    assert complete(client, prompt=ids).status_code == 200
    assert backend.calls[-1].prompt_token_ids == ids
    body = complete(client, prompt=["one", "two"], n=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    prompts = [c.prompt_token_ids for c in backend.calls[1:]]
    assert prompts == [tokenizer.encode("one")] * 2 + [tokenizer.encode("two")] * 2
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("one")) + len(tokenizer.encode("two"))
    complete(client, prompt=[ids, ids[:1]])
    assert [c.prompt_token_ids for c in backend.calls[5:]] == [ids, ids[:1]]


def test_logprobs_in_completions_format(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "Hi there", with_logprobs=True)
    body = complete(client, logprobs=1).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == ["Hi", " there", "<|im_end|>"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {"Hi": -0.5, ".": -1.5}
    assert logprobs["text_offset"] == [0, 2, 8]
    assert backend.calls[0].params.logprobs == 1


def test_streamed_logprob_offsets_continue_across_chunks(client, backend, tokenizer):
    backend.script = text_chunks(tokenizer, "Hi there", with_logprobs=True)
    events = parse_sse(complete(client, logprobs=0, stream=True).text)
    offsets = [
        o
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["logprobs"]
        for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 2, 8]


def test_ignore_eos_and_seed_reach_sampling_params(client, backend):
    complete(client, ignore_eos=True, seed=5, n=2, max_tokens=9, temperature=0.7)
    assert [c.params.seed for c in backend.calls] == [5, 6]
    assert all(c.params.ignore_eos and c.params.max_tokens == 9 and c.params.temperature == 0.7 for c in backend.calls)


def test_default_max_tokens_is_cut_to_the_context(client, backend, settings, tokenizer):
    long_prompt = [100] * (settings.max_model_len - 4)
    complete(client, prompt=long_prompt)
    assert backend.calls[0].params.max_tokens == 4
