"""Paged attention in plain torch: the CPU path and the reference for other kernels.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads,
head_dim]; a token's K/V live at slot `block_id * block_size + offset`. A
sequence's keys are found through its block table.

A step's tokens arrive flattened, sequence after sequence. Sequences that
compute one token (decodes) come first, then those computing several (prompt
chunks). Each group is attended in one batched call:

- decodes: one query per sequence over its gathered context;
- chunks: queries padded to the longest chunk, each query seeing the cached
  context before its chunk plus the chunk up to itself (causal).

Grouped-query attention is handled without repeating K/V: the query heads
that share a KV head are folded into the query-length dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every attention layer of the model."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    num_decode_tokens: int  # the first tokens, one per decoding sequence
    # The plain layout, every sequence (what the Triton kernels read):
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32: cached context + this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's tokens start
    max_query_len: int
    # The padded layouts of the torch path:
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_ctx] bool: key is real
    prefill_block_tables: torch.Tensor  # [num_chunks, max_blocks] int64
    prefill_query_index: torch.Tensor  # [num_chunks, max_q] int64 into the chunk tokens
    prefill_query_valid: torch.Tensor  # [num_chunks, max_q] bool
    prefill_mask: torch.Tensor  # [num_chunks, 1, max_q, max_ctx] bool
    _bias_cache: dict[tuple[int, torch.dtype], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def num_prefills(self) -> int:
        return self.prefill_block_tables.shape[0]

    def prefill_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The chunk mask as an additive bias, its rows repeated for `group` query heads.

        Built once per step and dtype and shared by every layer.
        """
        key = (group, dtype)
        if key not in self._bias_cache:
            mask = self.prefill_mask.repeat(1, 1, group, 1)  # [n, 1, group * max_q, max_ctx]
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._bias_cache[key] = bias.masked_fill_(~mask, float("-inf"))
        return self._bias_cache[key]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(
            **{f.name: _moved(getattr(self, f.name), device) for f in fields(self) if f.init}
        )


def _moved(value: object, device: torch.device | str) -> object:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Lay out one step. Sequences with query_len 1 must come first.

    `context_lens[i]` counts all of sequence i's tokens after this step's
    tokens are written (cached context + its query chunk).
    """
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError("sequences with a single query token must come first")

    slots: list[int] = []
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        for pos in range(ctx - q_len, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)

    dec_tables, dec_mask = _gathered_layout(
        context_lens[:num_decodes], block_tables[:num_decodes], block_size
    )
    pre_q = query_lens[num_decodes:]
    pre_ctx = context_lens[num_decodes:]
    pre_tables, pre_key_valid = _gathered_layout(pre_ctx, block_tables[num_decodes:], block_size)
    max_q = max(pre_q, default=1)
    q_lens = torch.tensor(pre_q, dtype=torch.int64).view(-1, 1)
    q_pos = torch.arange(max_q).view(1, -1)
    query_valid = q_pos < q_lens  # [chunks, max_q]
    starts = torch.tensor([0, *pre_q], dtype=torch.int64).cumsum(0)[:-1].view(-1, 1)
    query_index = torch.where(query_valid, starts + q_pos, torch.zeros_like(q_pos))
    # Absolute position of each query; a key at position j is visible iff j <= it.
    first_pos = torch.tensor(pre_ctx, dtype=torch.int64).view(-1, 1) - q_lens
    q_abs = first_pos + q_pos  # [chunks, max_q]
    key_pos = torch.arange(pre_tables.shape[1] * block_size).view(1, 1, -1)
    mask = (key_pos <= q_abs.unsqueeze(-1)) & pre_key_valid.unsqueeze(1)
    # Padding queries see key 0 so their (discarded) softmax stays finite.
    mask[..., 0] |= ~query_valid
    all_tables, _ = _gathered_layout(context_lens, block_tables, block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=num_decodes,
        block_tables=all_tables.to(torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0).to(torch.int32),
        max_query_len=max(query_lens, default=0),
        decode_block_tables=dec_tables,
        decode_mask=dec_mask[:, None, None, :],
        prefill_block_tables=pre_tables,
        prefill_query_index=query_index,
        prefill_query_valid=query_valid,
        prefill_mask=mask.unsqueeze(1),
    )


def _gathered_layout(
    context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded block tables [n, max_blocks] and key validity [n, max_blocks * block_size]."""
    n = len(context_lens)
    max_blocks = max((-(-c // block_size) for c in context_lens), default=1)
    tables = torch.zeros(n, max_blocks, dtype=torch.int64)
    for i, (ctx, table) in enumerate(zip(context_lens, block_tables, strict=True)):
        used = -(-ctx // block_size)
        tables[i, :used] = torch.tensor(table[:used], dtype=torch.int64)
    lens = torch.tensor(context_lens, dtype=torch.int64).view(-1, 1)
    valid = torch.arange(max_blocks * block_size).view(1, -1) < lens
    return tables, valid


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [n, max_blocks] tables -> keys [n, kv_heads, max_blocks * block_size, d].
    # index_select on the flat table is several times faster than cache[tables].
    n, max_blocks = block_tables.shape
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(n, max_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    nd = meta.num_decode_tokens
    if nd:
        # [nd, kv_heads, group, d]: the group's queries share their KV head.
        q = query[:nd].view(nd, num_kv_heads, group, head_dim)
        k = _gather(k_cache, meta.decode_block_tables)
        v = _gather(v_cache, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
        if not meta.num_prefills:  # the common all-decode step: no output buffer needed
            return o.view(nd, num_heads, head_dim)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = o.view(nd, num_heads, head_dim)

    if meta.num_prefills:
        chunks = query[nd:]
        n, max_q = meta.prefill_query_index.shape
        # [n, max_q, kv_heads, group, d] -> [n, kv_heads, group * max_q, d]
        q = chunks[meta.prefill_query_index].view(n, max_q, num_kv_heads, group, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group * max_q, head_dim)
        k = _gather(k_cache, meta.prefill_block_tables)
        v = _gather(v_cache, meta.prefill_block_tables)
        bias = meta.prefill_bias(group, query.dtype)  # [n, 1, group * max_q, max_ctx]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        # [n, kv_heads, group, max_q, d] -> [n, max_q, heads, d]
        o = o.view(n, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(n, max_q, num_heads, head_dim)
        out[nd:] = o[meta.prefill_query_valid]
    return out
