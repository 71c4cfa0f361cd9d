"""pdserve's shared core: no network code. Config, requests, paged KV cache with prefix caching,
the model and its runner, the scheduler and the engine loop.

Names are imported lazily so that torch-free modules (block hashing, sampling params, model
resolution) can be used by the gateway without importing torch.
"""

import importlib

_EXPORTS = {
    "CacheConfig": "pdserve.engine.config",
    "EngineConfig": "pdserve.engine.config",
    "SchedulerConfig": "pdserve.engine.config",
    "EngineLoad": "pdserve.engine.scheduler",
    "HeldPrompt": "pdserve.engine.llm_engine",
    "KvCacheSpec": "pdserve.engine.kv_cache",
    "KvCacheStorage": "pdserve.engine.kv_cache",
    "LayerHook": "pdserve.engine.llm_engine",
    "LLMEngine": "pdserve.engine.llm_engine",
    "LocalKvCacheStorage": "pdserve.engine.kv_cache",
    "Request": "pdserve.engine.request",
    "RequestOutput": "pdserve.engine.request",
    "RequestStatus": "pdserve.engine.request",
    "TokenLogprob": "pdserve.engine.request",
    "SamplingParams": "pdserve.engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
