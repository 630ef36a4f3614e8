"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary (padded so it divides).
The embedding zeroes tokens outside its slice and all-reduces; the LM head
computes logits for its slice and gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_gather_last_dim, all_reduce, tp_rank, tp_world_size
from .cpu_gemm import PackedWeight
from .linear import set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size = tp_world_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding of shape {tuple(loaded.shape)}, expected ({self.vocab_size}, {param.shape[1]})"
            )
        part = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share the embedding's weight."""

    packed: PackedWeight | None = None

    def pack(self, batch_hint: int) -> bool:
        # A packed copy: a tied weight is still the embedding's lookup table.
        self.packed = PackedWeight.try_pack(self.weight, batch_hint)
        return self.packed is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, vocab]
        local = self.packed.linear(hidden, None) if self.packed else F.linear(hidden, self.weight)
        logits = all_gather_last_dim(local)
        return logits[:, : self.vocab_size]
