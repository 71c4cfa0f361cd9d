"""Frozen engine configuration, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.model_loader import DEFAULT_MODEL

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache.

    `num_blocks=None` sizes the pool once the model is known: from `kv_cache_memory_bytes` on
    CPU; on CUDA from the GPU's memory, of which the engine takes `gpu_memory_utilization` in all
    (weights, activations and KV cache), as vLLM's flag of that name does.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # auto: the model's dtype, but float16 under quantized float32 weights (EngineConfig). A 16-bit
    # cache under float32 weights halves the KV bytes a decode step reads (and the memory per
    # token); K and V are stored rounded, so outputs may differ.
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"the KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (or None to size from memory), got {self.num_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: tokens in one forward pass and sequences in the running batch."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs: which model, where it runs, and the cache and scheduler shapes.

    `model` is an alias (e.g. `smollm2-135m`), a Hugging Face folder or a `.gguf` file.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "torch"
    quantization: str = "none"  # weight-only: none | int8 | int4 (pdserve/engine/quantization.py)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in ("none", "int8", "int4"):
            raise ValueError(f"quantization must be none, int8 or int4, got {self.quantization!r}")
        if self.attention_backend not in ("torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be torch, cpu or triton, got {self.attention_backend!r}")
        if self.attention_backend == "triton" and self.kv_cache_dtype != self.dtype:
            raise ValueError(
                f"--kv-cache-dtype {self.cache.dtype} under --dtype {self.dtype} needs --attention-backend torch or cpu"
            )
        if self.quantization != "none" and not self.device.startswith("cpu"):
            raise ValueError(f"--quantization {self.quantization} runs on torch's CPU kernels only, not {self.device}")
        if not self.model:
            raise ValueError("model must name an alias, a Hugging Face folder or a .gguf file")

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype: `cache.dtype`; for auto, the model's, or float16 under quantized weights.

        Quantized weights already give up float32's exact tokens for speed, and a float16 cache costs
        nothing measurable on top of them (docs/benchmarks.md, "twentieth pass") while halving the
        bytes a decode step's attention reads: the cache llama.cpp keeps by default, too. Unquantized
        float32 keeps a float32 cache, token-identical to transformers.
        """
        if self.cache.dtype != "auto":
            return self.cache.dtype
        return "float16" if self.quantization != "none" and self.dtype == "float32" else self.dtype
