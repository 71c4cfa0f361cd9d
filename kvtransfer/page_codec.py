"""PushKv messages encoded and decoded around the page bytes, so that they are copied once per side.

The messages are ordinary `PushKvRequest` protobufs on the wire (any protobuf library parses
them), but going through generated classes costs three copies of every page on the sender
(tensor to bytes, bytes into the message, message to wire) and two on the receiver. Here the
sender writes each page's small header fields with protobuf and joins the page's raw bytes
straight from the KV cache after them (protobuf allows fields in any order); the receiver
walks the wire format, parses the headers with protobuf and hands the page bytes on as
zero-copy views. Pages travel several to a message (`batch_pages`): per-message costs in
gRPC, not bytes, limit a loopback stream of sub-megabyte pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtransfer.base import MAX_MESSAGE_BYTES, KvCommit, KvPage
from protos import kv_transfer_pb2
from protos.convert import logprob_from_proto, logprob_to_proto

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_COMMIT, _PAGES = 2, 3  # PushKvRequest fields
_PAGE = 1  # KvPageBatch.pages
_DATA = 7  # KvPage.data


def batch_pages(pages: Iterable[KvPage], max_bytes: int = MAX_MESSAGE_BYTES) -> Iterator[list[KvPage]]:
    """Consecutive pages grouped into batches of at most max_bytes of data (at least one page each)."""
    batch: list[KvPage] = []
    size = 0
    for page in pages:
        if batch and size + len(page.data) > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(page)
        size += len(page.data)
    if batch:
        yield batch


def encode_pages(pages: list[KvPage]) -> bytes:
    """The wire bytes of a PushKvRequest carrying a batch of pages."""
    parts = []
    for page in pages:
        parts += _encode_page(page)
    batch_length = sum(len(part) for part in parts)
    return b"".join((_key(_PAGES, _LENGTH_DELIMITED), _varint(batch_length), *parts))


def encode_commit(commit: KvCommit) -> bytes:
    return kv_transfer_pb2.PushKvRequest(commit=commit_to_proto(commit)).SerializeToString()


def decode_request(raw: bytes) -> list[KvPage] | KvCommit:
    """A PushKvRequest from its wire bytes; each page's data is a view into `raw`, not a copy."""
    view = memoryview(raw)
    for field, start, end in _length_delimited_fields(view, 0, len(view)):
        if field == _COMMIT:
            return commit_from_proto(kv_transfer_pb2.KvCommit.FromString(view[start:end]))
        if field == _PAGES:
            return [_decode_page(view, s, e) for f, s, e in _length_delimited_fields(view, start, end) if f == _PAGE]
    raise ValueError("PushKvRequest carries neither pages nor a commit")


def _encode_page(page: KvPage) -> list:
    """A KvPageBatch.pages entry: header fields, then the data field over the page's own buffer."""
    header = kv_transfer_pb2.KvPage(
        request_id=page.request_id,
        layer=page.layer,
        kind=page.kind,
        block_index=page.block_index,
        num_blocks=page.num_blocks,
        dtype=page.dtype,
    ).SerializeToString()
    data = memoryview(page.data).cast("B")
    data_key = _key(_DATA, _LENGTH_DELIMITED) + _varint(data.nbytes)
    page_length = len(header) + len(data_key) + data.nbytes
    return [_key(_PAGE, _LENGTH_DELIMITED) + _varint(page_length) + header + data_key, data]


def commit_to_proto(commit: KvCommit) -> kv_transfer_pb2.KvCommit:
    message = kv_transfer_pb2.KvCommit(
        request_id=commit.request_id,
        first_token_id=commit.first_token_id,
        pages_in_shared_memory=commit.pages_in_shared_memory,
    )
    if commit.first_logprob is not None:
        message.first_logprob.CopyFrom(logprob_to_proto(commit.first_logprob))
    return message


def commit_from_proto(c: kv_transfer_pb2.KvCommit) -> KvCommit:
    logprob = logprob_from_proto(c.first_logprob) if c.HasField("first_logprob") else None
    return KvCommit(c.request_id, c.first_token_id, logprob, c.pages_in_shared_memory)


def _decode_page(view: memoryview, start: int, end: int) -> KvPage:
    data = memoryview(b"")
    header = bytearray()  # every field but the data, re-parsed by protobuf (a few dozen bytes)
    position = start
    while position < end:
        field_start = position
        key, position = _read_varint(view, position)
        field, wire_type = key >> 3, key & 7
        if field == _DATA and wire_type == _LENGTH_DELIMITED:
            length, position = _read_varint(view, position)
            data = view[position : position + length]
            position += length
        else:
            position = _skip(view, position, wire_type)
            header += view[field_start:position]
    if position != end:
        raise ValueError("truncated KvPage")
    h = kv_transfer_pb2.KvPage.FromString(bytes(header))
    return KvPage(h.request_id, h.layer, int(h.kind), h.block_index, h.num_blocks, h.dtype, data)


def _length_delimited_fields(view: memoryview, position: int, end: int):
    """(field number, start, end) of each length-delimited field; other wire types are skipped."""
    while position < end:
        key, position = _read_varint(view, position)
        if key & 7 == _LENGTH_DELIMITED:
            length, position = _read_varint(view, position)
            if position + length > end:
                raise ValueError("truncated PushKvRequest")
            yield key >> 3, position, position + length
            position += length
        else:
            position = _skip(view, position, key & 7)


def _skip(view: memoryview, position: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(view, position)[1]
    if wire_type == _LENGTH_DELIMITED:
        length, position = _read_varint(view, position)
        return position + length
    if wire_type in (_FIXED64, _FIXED32):
        return position + (8 if wire_type == _FIXED64 else 4)
    raise ValueError(f"unsupported protobuf wire type {wire_type}")


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(view) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)
