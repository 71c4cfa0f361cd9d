"""The OpenAI wire format: request and response bodies of /v1/completions, /v1/chat/completions
and /v1/models, the streamed chunk objects, and the error body.

Requests tolerate unknown fields (clients send many) but reject known ones the engine cannot honour,
so that a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

MAX_LOGPROBS = 20  # SamplingParams' limit
INT32_MAX = 2**31 - 1  # token ids, counts and lengths travel as protobuf int32
INT64_MAX = 2**63 - 1  # the seed travels as protobuf int64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\ud800" escapes; no UTF-8 encodes them

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


def _check_text(value: Any) -> None:
    """Raises ValueError if any string in a JSON value holds a lone surrogate (the tokenizer and
    protobuf need valid UTF-8). NUL and other control characters are valid text and pass."""
    if isinstance(value, str):
        if _LONE_SURROGATE.search(value):
            raise ValueError("the text holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode")
    elif isinstance(value, list):
        for item in value:
            _check_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields both endpoints share. None means "the default" (clients send explicit nulls)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="0 or -1 disables top-k, at most the vocabulary size (vLLM extension)"
    )
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description="choice i samples with seed + i")
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(
        None, description="extra token ids that end the sequence (vLLM extension)"
    )
    ignore_eos: bool = Field(False, description="keep generating past EOS until max_tokens (vLLM extension)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        _check_text(value)
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value:
            raise ValueError(f"{info.field_name} is not supported; send 0 or leave it out")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="a string, a list of strings, a list of token ids or a list of token id lists"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the N most likely alternatives per token")
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise ValueError("the prompt must not be empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) go to the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextContentPart] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump()
        if isinstance(self.content, list):
            # Text parts join with newlines, as vLLM's "string" content format does.
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(None, description="preferred over max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant header (vLLM extension)")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return top_logprobs


# -- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description='"stop", "length" or "abort"')


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed completion; the last one (with stream_options.include_usage)
    has no choices and the usage."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a chunk adds to the message; unset fields are left out ({} in the finishing chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion; the last one (with
    stream_options.include_usage) has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
