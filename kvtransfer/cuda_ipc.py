"""A GPU KV cache shared between processes on one host with CUDA IPC: export on the decode node,
open on a prefill node (cuda_ipc_transport.py), and in `make gpu-check`, which measures it.

The handle is encoded as JSON, never pickled: the process that opens it did not make it. It
names the GPU by UUID, since two processes may number their visible GPUs differently.
Imports torch only, so the GPU check can use it on a machine without the serving stack.
"""

from __future__ import annotations

import base64
import json

import torch

from pdserve.engine.kv_cache import kv_caches_over

_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def export_kv_cache(stacked: torch.Tensor) -> bytes:
    """The CUDA IPC handle of a [layers, 2, blocks, ...] cache on a GPU, as bytes for the reply.
    The caller keeps the tensor alive while other processes may open the handle."""
    storage = stacked.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    fields = {
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "handle": handle,
        "size_bytes": size,
        "offset_bytes": offset,
        "ref_counter_handle": ref_handle,
        "ref_counter_offset": ref_offset,
        "event_handle": event_handle,
        "event_sync_required": event_sync,
        "storage_offset": stacked.storage_offset(),
        "shape": list(stacked.shape),
        "stride": list(stacked.stride()),
    }
    for name in _BYTES_FIELDS:
        fields[name] = base64.b64encode(fields[name] or b"").decode()
    return json.dumps(fields).encode()


def local_device_index(uuid: str) -> int | None:
    """This process's index of the GPU with that UUID, or None if it cannot see it."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def open_kv_caches(blob: bytes, layout: str):
    """Per-layer (K, V) views of another process's exported cache, or None if this process
    cannot see its GPU or the handle does not describe a cache of `layout`."""
    fields = json.loads(blob)
    device = local_device_index(fields["uuid"])
    dtype = getattr(torch, layout.rsplit(",", 1)[-1], None)
    expected_shape = [int(n) for n in layout.split(",")[:1]] + [2] + [int(n) for n in layout.split(",")[1:5]]
    if device is None or dtype is None or fields["shape"] != expected_shape:
        return None
    raw = {name: base64.b64decode(fields[name]) for name in _BYTES_FIELDS}
    storage = torch.UntypedStorage._new_shared_cuda(
        device, raw["handle"], fields["size_bytes"], fields["offset_bytes"],
        raw["ref_counter_handle"], fields["ref_counter_offset"], raw["event_handle"], fields["event_sync_required"],
    )  # fmt: skip
    stacked = torch.empty((0,), dtype=dtype, device=f"cuda:{device}")
    stacked.set_(storage, fields["storage_offset"], fields["shape"], fields["stride"])
    return kv_caches_over(stacked)
