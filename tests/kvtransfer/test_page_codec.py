"""The hand-written PushKv codec speaks plain protobuf: checked against the generated classes."""

from __future__ import annotations

import pytest

from kvtransfer.base import KEY, VALUE, KvCommit, KvPage
from kvtransfer.page_codec import batch_pages, decode_request, encode_commit, encode_pages
from pdserve.engine.request import TokenLogprob
from protos import kv_transfer_pb2


def page(layer: int, kind: int = KEY, num_bytes: int = 300, request_id: str = "req-é") -> KvPage:
    data = bytes((layer * 7 + i) % 256 for i in range(num_bytes))
    return KvPage(request_id, layer, kind, block_index=layer * 2, num_blocks=2, dtype="float32", data=data)


def fields(p: KvPage) -> tuple:
    return (p.request_id, p.layer, p.kind, p.block_index, p.num_blocks, p.dtype, bytes(p.data))


def test_encoded_pages_parse_with_protobuf():
    pages = [page(0), page(1, VALUE, num_bytes=200_000), page(29, num_bytes=0)]
    message = kv_transfer_pb2.PushKvRequest.FromString(encode_pages(pages))
    assert message.WhichOneof("item") == "pages"
    parsed = [
        KvPage(m.request_id, m.layer, int(m.kind), m.block_index, m.num_blocks, m.dtype, m.data)
        for m in message.pages.pages
    ]
    assert [fields(p) for p in parsed] == [fields(p) for p in pages]


def test_protobuf_encoded_pages_decode_as_views():
    pages = [page(3, VALUE), page(4)]
    message = kv_transfer_pb2.PushKvRequest()
    for p in pages:
        message.pages.pages.add(
            request_id=p.request_id,
            layer=p.layer,
            kind=p.kind,
            block_index=p.block_index,
            num_blocks=p.num_blocks,
            dtype=p.dtype,
            data=p.data,
        )
    raw = message.SerializeToString()
    decoded = decode_request(raw)
    assert [fields(p) for p in decoded] == [fields(p) for p in pages]
    assert all(isinstance(p.data, memoryview) and p.data.obj is raw for p in decoded)  # no copy of the bytes


def test_pages_sent_from_a_memoryview_round_trip():
    view = memoryview(bytearray(range(256)) * 4)
    p = KvPage("r", 2, KEY, 0, 1, "bfloat16", view)
    (decoded,) = decode_request(encode_pages([p]))
    assert fields(decoded) == fields(p)


def test_commit_round_trips_with_its_logprob():
    commit = KvCommit("r", 42, TokenLogprob(42, -0.25, {42: -0.25, 7: -2.5}), pages_in_shared_memory=True)
    assert decode_request(encode_commit(commit)) == commit
    assert decode_request(encode_commit(KvCommit("s", 0))) == KvCommit("s", 0)


def test_batches_stay_under_the_byte_limit_and_keep_order():
    pages = [page(layer, num_bytes=400) for layer in range(10)]
    batches = list(batch_pages(pages, max_bytes=1000))
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2]
    assert [p for b in batches for p in b] == pages
    assert [len(b) for b in batch_pages([page(0, num_bytes=5000), page(1)], max_bytes=1000)] == [
        1,
        1,
    ]  # an oversized page goes alone


@pytest.mark.parametrize("raw", [b"", b"\x1a\x05abc", b"\x1a\x02\x0a\x7f", b"\x1a\x80"])
def test_malformed_messages_raise(raw):
    with pytest.raises(ValueError):
        decode_request(raw)
