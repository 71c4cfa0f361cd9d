"""The gateway's settings: read once at the entry point (arguments or PDSERVE_GATEWAY_* variables)
and passed down."""

from __future__ import annotations

import enum

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve.engine.model_loader import DEFAULT_MODEL


class RoutingPolicy(enum.StrEnum):
    """How the router picks nodes (gateway/router.py)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    PREFIX_AWARE = "prefix_aware"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PDSERVE_GATEWAY_", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="alias (smollm2-135m), Hugging Face folder or .gguf file")
    served_model_name: str | None = Field(None, description="the name clients send; default: the model's own name")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    redis_url: str | None = Field(None, description="the cluster's Redis; default: the embedded one")
    max_model_len: int | None = Field(
        None, ge=1, description="prompt + output tokens; default: config.json max_position_embeddings"
    )
    router_policy: RoutingPolicy = Field(
        RoutingPolicy.PREFIX_AWARE, description="how prefill and decode nodes are picked"
    )
    router_load_factor: float = Field(
        1.25,
        ge=1.0,
        description="bounded-load cap: a node above this factor x its role's mean load gets no new request",
    )
    log_level: str = "info"
    access_log: bool = Field(False, description="one log line per HTTP request")
