"""The benchmark's streaming client against scripted responses from a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket

import pytest
from aiohttp import web

from pdserve.bench.client import ClientConfig, StreamingClient
from pdserve.bench.workloads import user


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


DONE = b"[DONE]"
HI = (user("hi"),)
USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


@contextlib.asynccontextmanager
async def serving(handler):
    """An HTTP server on 127.0.0.1 whose every request `handler` answers; yields its root URL."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def send(handler, messages=HI, max_tokens=3, **config):
    """Runs one request through a client against a server answering with `handler`; returns
    (record, text, requests), each request as (path, JSON body)."""
    requests = []

    async def recording_handler(request: web.Request):
        requests.append((request.path, json.loads(await request.read())))
        return await handler(request)

    async def main():
        async with serving(recording_handler) as url:
            client_config = ClientConfig(base_url=url + "/v1", model="m", **config)
            async with StreamingClient(client_config) as client:
                return await client.send(list(messages), max_tokens)

    record, text = asyncio.run(main())
    return record, text, requests


def send_to_raw_server(connected, num_requests: int = 1) -> list:
    """Sends requests through one client to a raw asyncio server on 127.0.0.1 whose connections
    `connected(reader, writer)` answers; returns each send's (record, text)."""

    async def main():
        server = await asyncio.start_server(connected, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            config = ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m", timeout_s=5)
            async with StreamingClient(config) as client:
                return [await client.send(list(HI), 3) for _ in range(num_requests)]
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


def stream_of(body: bytes, status: int = 200):
    async def handler(request):
        return web.Response(status=status, body=body, content_type="text/event-stream")

    return handler


def test_completions_stream_records_content_chunks_and_usage():
    body = sse(
        {"choices": [{"index": 0, "text": "a"}]},
        {"choices": [{"index": 0, "text": ""}]},
        {"choices": [{"index": 0, "text": "b"}]},
        {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
        USAGE,
        DONE,
    )
    record, text, requests = send(stream_of(body))
    assert record.succeeded and text == "abc"
    assert len(record.content_times_s) == 3  # the empty chunk carried no content
    assert (record.num_output_tokens, record.num_prompt_tokens) == (3, 7)
    assert record.start_s <= record.content_times_s[0] <= record.content_times_s[-1] <= record.end_s
    ((path, payload),) = requests
    assert path == "/v1/completions"
    assert payload == {
        "model": "m",
        "max_tokens": 3,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "prompt": "hi",
    }


def test_chat_stream_does_not_count_the_role_chunk_as_content():
    body = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        DONE,
    )
    record, text, requests = send(stream_of(body), endpoint="chat", ignore_eos=False)
    assert record.succeeded and text == "Hello" and len(record.content_times_s) == 2
    assert record.num_output_tokens is None and record.output_tokens == 2  # no usage: chunks stand for tokens
    ((path, payload),) = requests
    assert path == "/v1/chat/completions"
    assert payload["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in payload


def test_an_http_error_is_a_failed_request_with_the_openai_message():
    body = json.dumps({"error": {"message": "every node is full", "type": "server_error"}}).encode()
    record, _, _ = send(stream_of(body, status=429))
    assert not record.succeeded and record.error == "HTTP 429: every node is full"


@pytest.mark.parametrize(
    "body, error",
    [
        (
            sse({"choices": [{"index": 0, "text": "a"}]}, {"error": {"message": "node died"}}, DONE),
            "error event: node died",
        ),
        (sse({"choices": [{"index": 0, "text": "a"}]}), "stream ended without data: [DONE]"),
        (sse(USAGE, DONE), "no content streamed"),
        (b"data: {not json\n\n", "malformed event"),
    ],
)
def test_broken_streams_are_failed_requests(body, error):
    record, _, _ = send(stream_of(body))
    assert not record.succeeded and record.error.startswith(error)


def test_a_request_past_its_timeout_fails():
    async def slow(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse({"choices": [{"index": 0, "text": "a"}]}))
        await asyncio.sleep(5)
        await response.write(sse(DONE))
        return response

    record, _, _ = send(slow, timeout_s=0.2)
    assert record.error == "timed out after 0.2 s" and record.e2e_s < 2


def test_a_dropped_connection_is_a_failed_request():
    async def drop(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse({"choices": [{"index": 0, "text": "a"}]}))
        request.transport.close()  # mid-stream, with no last chunk
        return response

    record, _, _ = send(drop)
    assert not record.succeeded and record.content_times_s
    assert record.error == "the server closed the connection before the response ended"


def test_requests_after_a_server_drops_a_kept_alive_connection_still_succeed():
    # llama-server keeps connections alive and closes them on its own terms (half of its requests
    # failed "Can not write request body" when the client reused them): each request connects anew.
    body = sse({"choices": [{"index": 0, "text": "a"}]}, USAGE, DONE)

    async def first_request_only(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")  # a second request on this connection: drop it
        writer.transport.abort()

    records = [record for record, _ in send_to_raw_server(first_request_only, num_requests=3)]
    assert [record.error for record in records] == [None, None, None]


def test_a_refused_connection_is_a_failed_request():
    with socket.socket() as probe:  # a port nobody listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

        async def main():
            async with StreamingClient(ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m")) as client:
                return await client.send(list(HI), 3)

        record, _ = asyncio.run(main())
    assert record.error.startswith("ConnectionRefusedError: ")


def test_the_model_defaults_to_the_first_one_listed():
    async def handler(request):
        assert request.path == "/v1/models"
        return web.json_response({"object": "list", "data": [{"id": "first"}, {"id": "second"}]})

    async def main():
        async with serving(handler) as url, StreamingClient(ClientConfig(base_url=url)) as client:
            return client.model

    assert asyncio.run(main()) == "first"


def test_an_event_of_many_packets_is_read_whole():
    text = "x" * 200_000  # one event of ~200 KB, as a chunk with many logprobs may be
    body = sse({"choices": [{"index": 0, "text": text}]}, DONE)
    record, received, _ = send(stream_of(body))
    assert record.succeeded and received == text


def test_token_id_prompts_need_the_completions_endpoint():
    with pytest.raises(ValueError, match="--endpoint completions"):
        send(stream_of(sse(DONE)), messages=(user([1, 2, 3]),), endpoint="chat")


def test_each_event_is_timed_by_the_arrival_of_its_last_byte():
    # Events split across writes, one of them mid-line and one mid-chunk-header: an event's time is
    # when its last byte came, not when the stream was parsed.
    first, second = sse({"choices": [{"index": 0, "text": "a"}]}), sse({"choices": [{"index": 0, "text": "b"}]})

    async def paced(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first[:10])
        await asyncio.sleep(0.2)
        await response.write(first[10:] + second[:5])
        await asyncio.sleep(0.2)
        await response.write(second[5:] + sse(USAGE, DONE))
        return response

    record, text, _ = send(paced)
    assert record.succeeded and text == "ab"
    first_s, second_s = (t - record.start_s for t in record.content_times_s)
    assert 0.15 < first_s < second_s - 0.15 and second_s < record.e2e_s


def test_the_api_key_is_sent_as_a_bearer_token():
    seen = []

    async def handler(request):
        seen.append(request.headers.get("Authorization"))
        return await stream_of(sse({"choices": [{"index": 0, "text": "a"}]}, DONE))(request)

    record, _, _ = send(handler, api_key="sk-test")
    assert record.succeeded and seen == ["Bearer sk-test"]


def test_a_response_that_is_not_http_is_a_failed_request():
    async def garbage(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        writer.close()

    ((record, _),) = send_to_raw_server(garbage)
    assert record.error.startswith("malformed HTTP response")
