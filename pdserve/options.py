"""Every option of the `pdserve` commands, defined once: name, type, default and help text.

An option is a field of a pydantic model. Options that travel together form a group
(`EngineOptions`, `KvTransferOptions`, and the gateway's `RouterOptions`); each command's settings
class is a pydantic-settings model made of groups plus its own fields. From that one definition:

    add_flags(parser, Settings)     the command's flags: --max-num-seqs, --prefix-caching/--no-prefix-caching
    Settings(...)                   PDSERVE_<COMMAND>_<NAME> environment variables (flags win over them)
    to_flags(settings, Group)       the flags `pdserve up` hands a child for the options it shares
                                    (a list field: its flag repeated, one value each)
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.settings import AdmissionOptions, ApiKeyOptions, GatewayListenOptions, RequestLimitOptions, RouterOptions
from pdserve.cluster_state.registry import RedisOptions
from pdserve.cluster_state.secret import ClusterSecretOptions
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.model_loader import DEFAULT_MODEL, MODEL_HELP
from pdserve.engine.sampling_params import SamplingParams
from protos.tls import GrpcTlsOptions

GIB = 1 << 30


class EngineOptions(BaseModel):
    """The engine inside every node (defaults are the engine's own: pdserve/engine/config.py)."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(DEFAULT_MODEL, description=MODEL_HELP)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        EngineConfig.dtype, description="weights and activations; the KV cache too unless --kv-cache-dtype"
    )
    device: str = Field(EngineConfig.device, description="torch device")
    attention_backend: Literal["torch", "cpu", "triton"] = Field(
        EngineConfig.attention_backend,
        description="torch: SDPA over gathered context; cpu: decode attention read in place from the "
        "paged cache by a C++ kernel, and pure-decode steps run as one C++ call (float32 on CPU; "
        "compiled on first use); triton: Triton kernels over the paged cache, fused RMSNorm and "
        "rotary, CUDA graphs for decode steps (--device cuda)",
    )
    gpu_memory_utilization: float = Field(
        CacheConfig.gpu_memory_utilization,
        gt=0,
        le=1,
        description="on CUDA: the share of the GPU's memory the engine takes (weights, activations, KV "
        "cache); the KV cache gets what is left of it (--kv-cache-gib applies on CPU)",
    )
    enforce_eager: bool = Field(
        EngineConfig.enforce_eager, description="on CUDA: run decode steps eagerly instead of from CUDA graphs"
    )
    quantization: Literal["none", "int8", "int4"] = Field(
        EngineConfig.quantization,
        description="weight-only quantized linear layers on CPU: int8 per channel, int4 in groups of 32 "
        "(the default model's own Q4_1 weights)",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        CacheConfig.dtype,
        description="auto: the model's dtype, or float16 under --quantization int8|int4; float16 or bfloat16 "
        "under float32 weights halve the KV bytes a decode step reads and the memory per token, with K and V "
        "stored rounded (outputs may differ from float32's; docs/benchmarks.md measures by how much)",
    )
    block_size: int = Field(CacheConfig.block_size, description="tokens per KV block, a power of two")
    kv_cache_gib: float = Field(CacheConfig.kv_cache_memory_bytes / GIB, gt=0, description="memory for the KV cache")
    max_num_batched_tokens: int = Field(
        SchedulerConfig.max_num_batched_tokens, ge=1, description="tokens in one forward pass (prefill chunks included)"
    )
    max_num_seqs: int = Field(SchedulerConfig.max_num_seqs, ge=1, description="sequences in the running batch")
    prefix_caching: bool = Field(CacheConfig.enable_prefix_caching, description="reuse cached prompt prefixes")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=int(self.kv_cache_gib * GIB),
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.prefix_caching,
                dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs
            ),
        )


class KvTransferOptions(BaseModel):
    """How prefill nodes push KV pages to decode nodes."""

    model_config = ConfigDict(frozen=True)

    kv_transport: Literal["auto", "grpc", "shm", "cuda_ipc"] = Field(
        "auto",
        description="auto: between nodes on one host, device to device (CUDA IPC) for GPU caches and shared "
        "memory for CPU ones, else the gRPC stream",
    )
    kv_lease_s: float = Field(
        10.0,
        gt=0,
        description="a decode node frees a prompt's reserved blocks once its prefill node has not renewed them "
        "for this long (renewed every third of it while the prompt is queued or computed)",
    )
    max_reserve_wait_s: float = Field(
        10.0, ge=0, description="how long a request waits for free KV blocks on a full decode node before 429"
    )


class TokenStreamOptions(BaseModel):
    """How a decode node streams a request's tokens to the gateway."""

    model_config = ConfigDict(frozen=True)

    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="tokens per streamed chunk after the first (the last chunk may hold fewer): a larger value "
        "spends less CPU per token on gRPC, HTTP and the client, and delivers tokens in bursts",
    )
    token_stream_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="decode nodes: the TCP port on --host of the token stream, which the gateway reads tokens from "
        "at a fraction of gRPC's CPU per message (TLS and the cluster secret as for gRPC); 0 picks a free one, "
        "-1 turns it off (the gateway then reads them over gRPC)",
    )


class NodeSettings(
    EngineOptions,
    KvTransferOptions,
    TokenStreamOptions,
    RedisOptions,
    ClusterSecretOptions,
    GrpcTlsOptions,
    BaseSettings,
):
    """`pdserve prefill|decode|colocated`: one node."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_NODE_", frozen=True)

    host: str = Field("127.0.0.1", description="the gRPC server's address")
    port: int = Field(0, ge=0, le=65535, description="the gRPC port; 0 picks a free one")
    advertise_host: str | None = Field(
        None,
        description="the host other nodes and the gateway dial; auto: this machine's own address "
        "(a container's on its network); default: --host, or auto when --host is 0.0.0.0 or ::",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics over HTTP on --host; 0 picks a free one (see the registry)"
    )
    node_id: str = Field("", description="the node's name in the registry; default: role-host-port-random")
    num_threads: int = Field(0, ge=0, description="torch threads; 0: torch's default")
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between registry heartbeats")
    ttl_s: float = Field(3.0, gt=0, description="a node missing heartbeats this long leaves the registry")
    drain_s: float = Field(
        8.0,
        ge=0,
        description="on SIGTERM, seconds the node keeps serving its open streams after leaving the registry "
        "(keep it under the supervisor's stop grace: compose's stop_grace_period, the launcher's 10 s)",
    )


class GenerateSettings(EngineOptions, BaseSettings):
    """`pdserve generate`: the engine offline, one JSON object per prompt and line."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_GENERATE_", frozen=True)

    max_tokens: int = Field(64, ge=1, description="tokens to generate per prompt")
    temperature: float = Field(SamplingParams.temperature, ge=0, description="0 for greedy")
    top_p: float = Field(SamplingParams.top_p, gt=0, le=1, description="nucleus sampling; 1 disables it")
    top_k: int = Field(SamplingParams.top_k, ge=-1, description="0 disables top-k")
    seed: int | None = Field(None, description="makes sampling reproducible")
    ignore_eos: bool = Field(SamplingParams.ignore_eos, description="generate max_tokens even past EOS")
    chat: bool = Field(False, description="apply the model's chat template")
    prompts_file: str | None = Field(None, description="one prompt per line")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class UpSettings(
    GatewayListenOptions,
    RouterOptions,
    AdmissionOptions,
    RequestLimitOptions,
    ApiKeyOptions,
    EngineOptions,
    KvTransferOptions,
    TokenStreamOptions,
    ClusterSecretOptions,
    GrpcTlsOptions,
    BaseSettings,
):
    """`pdserve up`: Redis, the nodes and the gateway on this machine. The engine, KV transfer and
    token stream options go to every node, the router, admission, request limit and API key
    options to the gateway, the gRPC TLS paths to all."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_UP_", frozen=True)

    prefill: int = Field(1, ge=0, description="number of prefill nodes")
    decode: int = Field(1, ge=0, description="number of decode nodes")
    colocated: bool = Field(False, description="one node doing prefill and decode, no KV transfer")
    redis_url: str | None = Field(None, description="use this Redis instead of starting an embedded one")
    log_dir: str | None = Field(None, description="keep each child's log here; default: a temporary folder")
    ready_timeout_s: float = Field(300.0, gt=0, description="give up if the cluster is not serving by then")

    @model_validator(mode="after")
    def _one_token_stream_port_per_decode_node(self) -> UpSettings:
        if self.token_stream_port > 0 and not self.colocated and self.decode > 1:
            raise ValueError(
                f"--token-stream-port {self.token_stream_port} would be taken by each of {self.decode} decode nodes "
                "on this machine: give 0 (a free port each) or -1 (over gRPC)"
            )
        return self


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], only: Collection[str] = ()) -> None:
    """One flag per field of `model` (or of the fields named in `only`). Flags default to
    SUPPRESS, so what is not given comes from the environment or the field's default."""
    env_prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        if not only or name in only:
            flag, help_text = f"--{name.replace('_', '-')}", _help(name, field, env_prefix)
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text, **_flag_kwargs(field))


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """`--model` for commands that parse their own flags (the benchmarks), from EngineOptions' field."""
    field = EngineOptions.model_fields["model"]
    parser.add_argument("--model", default=field.default, help=f"{field.description} (default: {field.default})")


def settings_from_args(model: type[BaseModel], args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The settings from the given flags (and the environment); a bad value exits with usage."""
    given = {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}
    try:
        return model(**given)
    except ValidationError as error:
        problems = "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in error.errors())
        parser.error(problems)


def to_flags(settings: BaseModel, *groups: type[BaseModel], exclude: Collection[str] = ()) -> list[str]:
    """The flags that give a child process the same values for every field of `groups`."""
    flags: list[str] = []
    for group in groups:
        for name in group.model_fields:
            value = getattr(settings, name)
            if name in exclude or value is None:
                continue
            flag = name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(f"--{flag}" if value else f"--no-{flag}")
            elif isinstance(value, list):
                flags += [part for item in value for part in (f"--{flag}", str(item))]
            else:
                flags += [f"--{flag}", str(value.value if isinstance(value, enum.Enum) else value)]
    return flags


def _flag_kwargs(field: FieldInfo) -> dict:
    kind = _without_none(field.annotation)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is Literal:
        return {"choices": typing.get_args(kind)}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return {"choices": [member.value for member in kind]}
    if typing.get_origin(kind) is list:  # a repeated flag: --api-key A --api-key B
        (item,) = typing.get_args(kind)
        return {"action": "append", "type": item, "metavar": item.__name__.upper()}
    return {"type": kind, "metavar": kind.__name__.upper()}


def _without_none(annotation):
    """`int | None` -> int: an optional value is given as the value itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return annotation


def _help(name: str, field: FieldInfo, env_prefix: str) -> str:
    default = "required" if field.is_required() else f"default: {_shown(field.default)}"
    return f"{field.description or ''} ({default}; env {env_prefix}{name.upper()})".replace("%", "%%")


def _shown(value) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)
