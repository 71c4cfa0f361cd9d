"""Issue 12's hostile inputs at the HTTP API: out-of-range integers, invalid text and errors on a
kept-alive connection each get a 400 (or are handled) in OpenAI's error shape, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.fakes import DEFAULT_TEXT, text_chunks
from tests.gateway.test_errors import assert_openai_error

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "smollm2", "prompt": "hi", "max_tokens": 4}
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 10**6}, "top_k"),  # beyond the vocabulary
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": INT64_MAX, "n": 2}, "seed"),  # the second choice's seed + 1 overflows
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),  # beyond the vocabulary
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"n": 2**31}, "n"),
    ],
)
@pytest.mark.parametrize(("path", "base"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_out_of_range_integers_are_400(client, path, base, fields, param):
    assert_openai_error(client.post(path, json={**base, **fields}), 400, param=param)


def test_largest_seed_that_fits_is_accepted(client):
    response = client.post("/v1/completions", json={**COMPLETION, "seed": INT64_MAX - 1, "n": 2})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("prompt", [[2**31], [[1, 2**40]], [-5]])
def test_prompt_token_ids_out_of_range_are_400(client, prompt):
    assert_openai_error(client.post("/v1/completions", json={**COMPLETION, "prompt": prompt}), 400, param="prompt")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 4}', "prompt"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 4}', "stop"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 4}', "messages"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "name": "\\ud83d"}]}', "messages"),
        ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ],
)
def test_lone_surrogates_are_400(client, path, body, param):
    response = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param=param)


def test_invalid_utf8_body_is_400(client):
    body = b'{"prompt": "\xff\xfe", "max_tokens": 4}'
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_nul_bytes_are_handled(client):
    response = client.post("/v1/completions", json={**COMPLETION, "prompt": "a\x00b", "stop": ["\x00"]})
    assert response.status_code == 200, response.text


def test_an_error_keeps_the_connection_alive(live_server, backend, tokenizer):
    """400s, a 404 and a 500 on one kept-alive connection, each followed by a good request on it."""
    chunks = text_chunks(tokenizer, DEFAULT_TEXT)

    def script(prompt_token_ids, params):
        if params.top_k == 7:  # what a protobuf overflow used to be: an unexpected exception
            raise ValueError("Value out of range")
        return chunks

    backend.script = script
    with httpx.Client(base_url=live_server, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        ports = set()

        def track(response: httpx.Response) -> httpx.Response:
            ports.add(response.extensions["network_stream"].get_extra_info("client_addr")[1])
            return response

        for bad, status in [
            ({**COMPLETION, "top_k": 2**31}, 400),
            ({**COMPLETION, "seed": 2**63}, 400),
            ({**COMPLETION, "model": "nope"}, 404),
            ({**COMPLETION, "top_k": 7}, 500),
        ]:
            response = track(http.post("/v1/completions", json=bad))
            assert response.status_code == status
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert track(http.post("/v1/completions", json=COMPLETION)).status_code == 200
        surrogate = b'{"prompt": "\\ud800", "max_tokens": 4}'
        response = http.post("/v1/completions", content=surrogate, headers={"content-type": "application/json"})
        assert track(response).status_code == 400
        assert track(http.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(ports) == 1, f"the connection was dropped: client ports {ports}"
