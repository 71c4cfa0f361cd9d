"""The decode role's choices for the node runtime: where its KV cache lives."""

from __future__ import annotations

from multiprocessing import shared_memory

import torch

from decode_service.server import DecodeNodeService, SharedMemoryKvStorage
from pdserve.engine.kv_cache import KvCacheSpec


def test_a_decode_node_shares_its_kv_cache_unless_told_grpc_or_colocated():
    assert isinstance(DecodeNodeService("auto", 10.0, 5.0).kv_storage, SharedMemoryKvStorage)
    assert isinstance(DecodeNodeService("shm", 10.0, 5.0).kv_storage, SharedMemoryKvStorage)
    assert DecodeNodeService("grpc", 10.0, 5.0).kv_storage is None
    assert DecodeNodeService("auto", 10.0, 5.0, colocated=True).kv_storage is None
    assert DecodeNodeService("auto", 10.0, 5.0, device="cuda").kv_storage is None  # a GPU cache: the gRPC stream
    assert DecodeNodeService("auto", 10.0, 5.0).layer_hook is None


def test_shared_memory_storage_hands_the_engine_a_zeroed_tensor_over_the_segment():
    storage = SharedMemoryKvStorage()
    spec = KvCacheSpec(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    tensor = storage.allocate(spec)
    try:
        assert tensor.shape == spec.shape and tensor.dtype == torch.float32
        assert not tensor.any()
        tensor[1, 1, 3] = 7.0  # layer 1, V, block 3
        mapped = shared_memory.SharedMemory(name=storage.segment.name)  # as a same-host prefill node maps it
        seen = torch.frombuffer(mapped.buf, dtype=torch.float32).view(spec.shape)
        assert seen[1, 1, 3].eq(7.0).all() and seen[1, 1, 2].eq(0).all() and seen[1, 0, 3].eq(0).all()
        del seen
        mapped.close()
    finally:
        storage.segment.unlink()
