"""The gateway's settings: read once at the entry point (flags or PDSERVE_GATEWAY_* variables, both
derived from these fields by pdserve/options.py) and passed down.

`RouterOptions`, `AdmissionOptions`, `ApiKeyOptions` and `GatewayListenOptions` are groups that
`pdserve up` shares: it takes the same options and hands them to its gateway."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.protocol import MAX_LOGPROBS
from pdserve.cluster_state.registry import RedisOptions
from pdserve.cluster_state.secret import ClusterSecretOptions
from pdserve.engine.model_loader import DEFAULT_MODEL, MODEL_HELP
from protos.tls import GrpcTlsOptions


class RoutingPolicy(enum.StrEnum):
    """How the router picks nodes (gateway/router.py)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    PREFIX_AWARE = "prefix_aware"


class RouterOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    router_policy: RoutingPolicy = Field(
        RoutingPolicy.PREFIX_AWARE,
        description="prefix_aware: where the prompt's prefix is cached, within a load cap; or least_load, round_robin",
    )
    router_load_factor: float = Field(
        1.25,
        ge=1.0,
        description="prefix_aware's cap: a node above this factor x its role's mean load gets no new request "
        "(queued prompt tokens beyond one batched step on prefill nodes, requests on decode nodes)",
    )
    router_max_attempts: int = Field(
        3, ge=1, description="attempts on other nodes, in a row, for a request whose nodes fail before a token is sent"
    )
    router_max_migrations: int = Field(
        2, ge=0, description="times a stream that breaks after tokens were sent resumes on other nodes (0: never)"
    )


class AdmissionOptions(BaseModel):
    """How much work the gateway admits (per node of each phase) before it answers 429."""

    model_config = ConfigDict(frozen=True)

    admission_prompt_tokens_per_prefill_node: int = Field(
        32768, ge=1, description="prompt tokens waiting for their first token, per prefill node, before 429"
    )
    admission_streams_per_decode_node: int = Field(
        256, ge=1, description="streams admitted and not finished, per decode node, before 429"
    )
    admission_retry_after_s: int = Field(1, ge=1, description="the Retry-After a 429 from admission carries")


class RequestLimitOptions(BaseModel):
    """What one request may ask for; beyond a limit the gateway answers 413 (the body) or 400 naming the field."""

    model_config = ConfigDict(frozen=True)

    max_request_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="a larger request body gets 413, before it is read whole"
    )
    max_choices_per_request: int = Field(128, ge=1, description="prompts x n: generations one request may start")
    max_stop_strings: int = Field(16, ge=0, description="stop strings one request may send")
    max_stop_string_chars: int = Field(1024, ge=1, description="characters in one stop string")
    max_stop_token_ids: int = Field(256, ge=0, description="stop_token_ids one request may send")
    max_logprobs: int = Field(
        MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS, description="logprobs / top_logprobs: alternatives per token"
    )
    max_output_tokens: int | None = Field(
        None, ge=1, description="max_tokens one choice may ask for; default: the rest of the model's context"
    )


class GatewayListenOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    host: str = Field("127.0.0.1", description="the gateway's HTTP address")
    port: int = Field(8000, ge=0, le=65535, description="the gateway's HTTP port")


class ApiKeyOptions(BaseModel):
    """Who may call the API (gateway/auth.py): with keys set, every route but /health needs
    `Authorization: Bearer <key>`."""

    model_config = ConfigDict(frozen=True)

    # NoDecode: the environment gives "k1,k2" rather than JSON; repr=False keeps keys out of logs.
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        repr=False,
        description="an API key clients must send as `Authorization: Bearer <key>`; repeat the flag, or separate "
        "keys with commas, for several; none: the API is open",
    )
    metrics_require_api_key: bool = Field(False, description="/metrics needs an API key too (when keys are set)")

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            return [key.strip() for item in value for key in str(item).split(",") if key.strip()]
        return value


class GatewaySettings(
    GatewayListenOptions,
    RouterOptions,
    AdmissionOptions,
    ApiKeyOptions,
    RequestLimitOptions,
    RedisOptions,
    ClusterSecretOptions,
    GrpcTlsOptions,
    BaseSettings,
):
    model_config = SettingsConfigDict(env_prefix="PDSERVE_GATEWAY_", frozen=True)

    model: str = Field(DEFAULT_MODEL, description=MODEL_HELP)
    served_model_name: str | None = Field(None, description="the name clients send; default: the model's own name")
    max_model_len: int | None = Field(
        None, ge=1, description="prompt + output tokens; default: config.json max_position_embeddings"
    )
    access_log: bool = Field(False, description="one log line per HTTP request")
