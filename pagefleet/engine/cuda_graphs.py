"""CUDA graphs of the compiled forward for all-decode steps, one per batch bucket.

A decode step of a small model on a GPU is bound by kernel launches, not by
arithmetic: even compiled, a forward of 30 layers launches a few hundred
kernels, each costing microseconds of CPU time. A CUDA graph records those
launches once and replays them with one call.

A graph replays fixed addresses and fixed shapes, so each bucket size B (1,
2, 4, 8, then multiples of 8 up to `max_num_seqs`, at most 256) is captured
over static buffers: token ids, positions, cache slots, block tables (as
wide as `max_model_len` needs) and context lengths for B sequences, and an
attention layout that says B decodes of at most `max_model_len` tokens (so
the decode kernel's split count is the same at every replay). A step of n
decodes copies its inputs into the first n rows and replays the smallest
bucket B >= n; rows n..B-1 are padding: token 0 at position 0, writing its
K/V into a scratch block outside the block manager's pool (the runner
allocates one more block than the pool for it) and attending over that one
position, so padding never touches a real sequence's cache and stays finite.
Steps with prompt chunks, or more decodes than the largest bucket, run the
compiled forward without a graph.

Capture runs each bucket twice first (Triton compiles its kernels then, not
during capture), largest first, all graphs sharing one memory pool.
`EngineConfig.enforce_eager` turns graphs off with compilation. This module
imports on any machine; `capture` is only called on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pagefleet.kernels import AttentionMetadata

from .config import EngineConfig, ResolvedCapacity
from .layers.attention import ForwardContext


class StepInputs(Protocol):
    """What a step gives a graph (model_runner.StepInputs; no import: no cycle)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


class ModelRunner(Protocol):
    """What capture reads of the model runner (model_runner.ModelRunner)."""

    config: EngineConfig
    capacity: ResolvedCapacity
    device: torch.device
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    compiled: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor] | None


MAX_GRAPH_BATCH = 256


def bucket_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ... up to the first that holds max_num_seqs (at most 256)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    candidates = [1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)]
    below = [c for c in candidates if c < top]
    return (*below, next(c for c in candidates if c >= top))


class DecodeGraphs:
    """The captured graphs of one model runner and the static buffers they read."""

    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...]) -> None:
        device = runner.device
        cap = runner.capacity
        top = max(sizes)
        self.sizes = sizes
        self.max_context_len = cap.max_model_len
        self.scratch_block = cap.num_kv_blocks  # the block past the pool's last
        self.scratch_slot = self.scratch_block * cap.block_size
        width = -(-cap.max_model_len // cap.block_size)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), self.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (top, width), self.scratch_block, dtype=torch.int32, device=device
        )
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self._kv_caches = runner.kv_caches
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _context(self, b: int) -> ForwardContext:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            num_decode_tokens=b,
            block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_decode_context_len=self.max_context_len,
        )
        return ForwardContext(meta, self._kv_caches)

    @classmethod
    def capture(cls, runner: ModelRunner) -> DecodeGraphs:
        assert runner.compiled is not None and runner.device.type == "cuda"
        compiled = runner.compiled
        pool = torch.cuda.graph_pool_handle()
        # Buffers made in inference mode, as a step's tensors are: the graph guards on it.
        with torch.inference_mode():
            graphs = cls(runner, bucket_sizes(runner.config.max_num_seqs))
            for b in sorted(graphs.sizes, reverse=True):
                ctx = graphs._context(b)
                ids, pos = graphs.input_ids[:b], graphs.positions[:b]
                side = torch.cuda.Stream(runner.device)
                side.wait_stream(torch.cuda.current_stream(runner.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        compiled(ids, pos, ctx)
                torch.cuda.current_stream(runner.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = compiled(ids, pos, ctx)
                graphs._graphs[b] = (graph, out)
        torch.cuda.synchronize(runner.device)
        return graphs

    def fits(self, inputs: StepInputs) -> bool:
        """Whether this step is all decodes, few enough for a captured bucket."""
        n = inputs.input_ids.shape[0]
        meta = inputs.meta
        return (
            inputs.input_ids.is_cuda
            and meta.num_decode_tokens == n
            and 0 < n <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, inputs: StepInputs, ctx: ForwardContext) -> torch.Tensor:
        """Replay the smallest bucket that holds the step: hidden states [n, hidden]."""
        n = inputs.input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        meta = inputs.meta
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if b > n:  # padding rows: the scratch slot, one position of context
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(self.scratch_slot)
            self.context_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].fill_(self.scratch_block)
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n]
