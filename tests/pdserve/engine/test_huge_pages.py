"""pdserve/engine/huge_pages.py: weights and CPU KV caches copied onto transparent huge pages,
values, identities and ties kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdserve.engine.huge_pages import HUGE_PAGE_BYTES, MIN_TENSOR_BYTES, empty_on_huge_pages, move_to_huge_pages
from pdserve.engine.kv_cache import KvCacheSpec, LocalKvCacheStorage

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    return THP_ENABLED.exists() and "[never]" not in THP_ENABLED.read_text()


def anon_huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 1024)
        self.proj = nn.Linear(1024, 1024)  # 4 MiB of weight, a 4 KiB bias that stays put
        self.head = nn.Linear(1024, 1024, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.randn(128, 1024))  # 512 KiB


def test_an_empty_tensor_starts_on_a_huge_page_boundary():
    tensor = empty_on_huge_pages((3 * HUGE_PAGE_BYTES + 5,))
    assert tensor.dtype == torch.uint8 and tensor.numel() == 3 * HUGE_PAGE_BYTES + 5
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    tensor.fill_(7)
    assert int(tensor[-1]) == 7


def test_moved_weights_keep_values_identities_and_ties():
    torch.manual_seed(0)
    model = TiedModel()
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    proj_weight, bias_ptr = model.proj.weight, model.proj.bias.data_ptr()
    moved = move_to_huge_pages(model)
    # embed/head once, proj.weight, the buffer; each rounded up to 64 bytes (all are already)
    assert moved == (2 * 1024 * 1024 + 128 * 1024) * 4
    assert model.proj.weight is proj_weight and model.head.weight is model.embed.weight
    assert model.proj.bias.data_ptr() == bias_ptr  # 4 KiB: under MIN_TENSOR_BYTES, not moved
    assert model.proj.bias.nbytes < MIN_TENSOR_BYTES
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(tensor, before[name]), name
    # One arena in module order: the first tensor at its start, on a huge page boundary.
    assert model.embed.weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert model.proj.weight.data_ptr() == model.embed.weight.data_ptr() + model.embed.weight.nbytes
    assert model.proj(torch.ones(2, 1024)).shape == (2, 1024)


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are off on this machine")
def test_the_kernel_backs_moved_weights_with_huge_pages():
    model = TiedModel()
    move_to_huge_pages(model)
    assert anon_huge_kib_at(model.embed.weight.data_ptr()) >= HUGE_PAGE_BYTES // 1024


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are off on this machine")
def test_a_local_cpu_kv_cache_is_zeroed_on_huge_pages():
    spec = KvCacheSpec(2, 64, 16, 2, 64, torch.float32, "cpu")  # 2 layers x K/V x 64 blocks: 2 MiB
    cache = LocalKvCacheStorage().allocate(spec)
    assert cache.shape == spec.shape and cache.dtype == torch.float32
    assert not cache.any()
    assert anon_huge_kib_at(cache.data_ptr()) >= HUGE_PAGE_BYTES // 1024
