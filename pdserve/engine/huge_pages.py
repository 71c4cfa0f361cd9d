"""Model weights on transparent huge pages (2 MiB) on the CPU.

A decode step streams every weight once. In a virtual machine each TLB miss walks two page
tables (the guest's and the host's), and with 4 KiB pages the walks, not the memory, bounded
the stream: on a 2-core AMD EPYC Zen 4 KVM guest, one thread summing 0.9 GB read 29 GB/s from
4 KiB pages and 59 GB/s from huge ones (docs/benchmarks.md, "fifteenth pass"). torch's CPU
allocator asks for huge pages only under an environment variable (THP_MEM_ALLOC_ENABLE) read
inside libc10, so the weights are copied, once, into anonymous mappings advised with
MADV_HUGEPAGE before their first touch; the kernel then backs them with huge pages wherever
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (a no-op where `never`).
"""

from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Each tensor starts on a cache line of its own; norm weights and biases (a few KiB) stay where
# they are, their reads are not a stream.
ALIGN_BYTES = 64
MIN_TENSOR_BYTES = 64 << 10


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A zeroed CPU tensor whose memory starts on a huge page boundary and is advised
    MADV_HUGEPAGE; its mapping lives as long as the tensor's storage. Anonymous memory comes
    zeroed from the kernel, page by page as it is first touched."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private: a shared anonymous mapping is shmem, which THP backs only as shmem_enabled says.
    # Anonymous mappings are page-aligned, not huge-page-aligned: map one huge page more and start
    # at the first boundary inside.
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -_address_of(mapping) % HUGE_PAGE_BYTES
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=start)
    return flat.view(dtype).view(shape)


def move_to_huge_pages(module: nn.Module) -> int:
    """Copies `module`'s CPU parameters and buffers of at least MIN_TENSOR_BYTES, in module order
    (the order a forward pass reads them), into one arena on huge pages. Parameters keep their
    identity (tied weights stay tied); buffers are replaced. Each original is let go as soon as
    its copy is made, so the peak is the weights plus one tensor, not twice the weights.
    Returns the bytes moved."""
    offsets, offset = {}, 0  # data_ptr -> its place: a tensor under two names moves once
    for tensor in [*module.parameters(), *module.buffers()]:
        if _worth_moving(tensor) and tensor.data_ptr() not in offsets:
            offsets[tensor.data_ptr()] = offset
            offset += tensor.nbytes + (-tensor.nbytes % ALIGN_BYTES)
    if not offsets:
        return 0
    arena = empty_on_huge_pages((offset,))
    for owner in module.modules():
        for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
            if tensor is None or (start := offsets.pop(tensor.data_ptr(), None)) is None:
                continue  # not moved, or a tied parameter already moved under its other name
            copy = arena[start : start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            if isinstance(tensor, nn.Parameter):
                tensor.data = copy
            else:
                owner._buffers[name] = copy
    logger.info("weights on huge pages: %.1f MiB", offset / 2**20)
    return offset


def _worth_moving(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.nbytes >= MIN_TENSOR_BYTES


def _address_of(mapping: mmap.mmap) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
