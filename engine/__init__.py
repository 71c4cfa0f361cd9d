"""pdserve's shared core: no network code. Config, requests, paged KV cache with prefix
caching, the model and its runner, the scheduler and the offline engine loop."""

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SchedulerConfig",
]
