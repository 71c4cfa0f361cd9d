"""CUDA graphs for pure-decode steps (`--device cuda --attention-backend triton`, unless --enforce-eager).

At small batches a decode step is mostly kernel launches: a few hundred per step, each a few
microseconds of CPU. A graph replays them all with one launch.

Lifecycle:
  1. at start-up, `capture` runs the model once per bucket size (1, 2, 4, 8, then every 8 up to
     --max-num-seqs), eagerly so Triton compiles, then records it reading static buffers. The
     largest bucket goes first; the smaller ones share its memory pool;
  2. `run` serves a step whose sequences all decode one token and fit the largest bucket: it
     copies the step's ids, positions, slots, block tables and context lengths into the
     buffers' first rows, pads the rest of the bucket (slot -1 writes no KV, context 1 reads
     one cached row of block 0), replays the smallest bucket that fits and returns the rows
     of the real sequences. Prefill steps and larger batches run eagerly.

The decode kernel's split count is fixed at capture, for the longest context the model allows;
splits past a sequence's context end at once.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.triton_backend import DecodeGroup, TritonAttentionMetadata
from pdserve.engine.models.llama import LlamaModel
from pdserve.engine.triton_kernels.attention import num_decode_splits


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Owns the static input buffers and one captured graph per bucket; mutates the KV cache on replay."""

    def __init__(self, model: LlamaModel, kv_caches, max_num_seqs: int, max_context_len: int, block_size: int) -> None:
        device = kv_caches[0][0].device
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_batch = self.buckets[-1]
        max_blocks = -(-max_context_len // block_size)
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(self.max_batch, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.num_splits = num_decode_splits(max_context_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        group = DecodeGroup(self.block_table[:size], self.context_lens[:size], self.num_splits)
        metadata = TritonAttentionMetadata(self.slot_mapping[:size], size, group, None)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, allocators settle
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = pool or graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of one pure-decode step of at most `max_batch` sequences."""
        num_seqs = len(input_ids)
        size = next(bucket for bucket in self.buckets if bucket >= num_seqs)
        width = max(len(table) for table in block_tables)
        tables = [table + [0] * (width - len(table)) for table in block_tables]
        self.input_ids[:num_seqs].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:num_seqs].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(torch.tensor(slots), non_blocking=True)
        self.block_table[:num_seqs, :width].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        self.context_lens[:num_seqs].copy_(torch.tensor(context_lens, dtype=torch.int32), non_blocking=True)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.context_lens[num_seqs:size].fill_(1)
        self.block_table[num_seqs:size, 0].fill_(0)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
