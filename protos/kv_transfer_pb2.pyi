from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_KEY: _ClassVar[KvKind]
    KV_KIND_VALUE: _ClassVar[KvKind]
KV_KIND_KEY: KvKind
KV_KIND_VALUE: KvKind

class KvPage(_message.Message):
    __slots__ = ("request_id", "layer", "kind", "block_index", "num_blocks", "dtype", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer: int
    kind: KvKind
    block_index: int
    num_blocks: int
    dtype: str
    data: bytes
    def __init__(self, request_id: _Optional[str] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[KvKind, str]] = ..., block_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvCommit(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "pages_in_shared_memory")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PAGES_IN_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    pages_in_shared_memory: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., pages_in_shared_memory: _Optional[bool] = ...) -> None: ...

class KvPageBatch(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[KvPage]
    def __init__(self, pages: _Optional[_Iterable[_Union[KvPage, _Mapping]]] = ...) -> None: ...

class PushKvRequest(_message.Message):
    __slots__ = ("pages", "commit")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    pages: KvPageBatch
    commit: KvCommit
    def __init__(self, pages: _Optional[_Union[KvPageBatch, _Mapping]] = ..., commit: _Optional[_Union[KvCommit, _Mapping]] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("released_request_ids", "lease_ms")
    RELEASED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    released_request_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ms: int
    def __init__(self, released_request_ids: _Optional[_Iterable[str]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class GetReservationRequest(_message.Message):
    __slots__ = ("reservation_token",)
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    reservation_token: str
    def __init__(self, reservation_token: _Optional[str] = ...) -> None: ...

class GetReservationResponse(_message.Message):
    __slots__ = ("block_ids", "num_cached_blocks", "shm_name", "host_id", "kv_layout", "cuda_ipc_handle")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    shm_name: str
    host_id: str
    kv_layout: str
    cuda_ipc_handle: bytes
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., shm_name: _Optional[str] = ..., host_id: _Optional[str] = ..., kv_layout: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ...) -> None: ...
