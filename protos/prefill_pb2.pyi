from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "decode_address", "reservation_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    decode_address: str
    reservation_token: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., reservation_token: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "finished", "finish_reason", "num_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    finished: bool
    finish_reason: str
    num_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...
