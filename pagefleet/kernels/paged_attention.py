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

Two per-layer options, with transformers' meanings:

- `sliding_window` W: a query at position p sees the keys at positions
  p - W < j <= p (W keys, itself included; `sliding_window_overlay` in
  transformers' masking_utils). Blocks wholly before a sequence's window may
  already be back in the pool: their table entries are never read as keys
  (this path gathers them but masks them; the cache is zero-initialised and
  only ever holds finite keys, so a masked score stays finite).
- `logits_soft_cap` c: scores (already scaled) become c * tanh(scores / c)
  before the mask and the softmax (Gemma 2's attention soft-capping).
- `sinks` [num_heads] float32: a learned logit per query head that joins the
  softmax's denominator and carries no value (gpt-oss's attention sinks):
  out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every attention layer of the model.

    The plain layout is all the Triton kernels read. The padded layouts are
    the torch path's; they are built only when asked for (`padded=True`,
    the CPU path), so a CUDA step neither builds nor moves nor pickles them.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    num_decode_tokens: int  # the first tokens, one per decoding sequence
    # The plain layout, every sequence (what the Triton kernels read):
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32: cached context + this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's tokens start
    max_query_len: int
    max_decode_context_len: int  # the longest decode's context (0 without decodes)
    # The padded layouts of the torch path (None when not built):
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_ctx] bool: key is real
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, max_blocks] int64
    prefill_query_index: torch.Tensor | None = (
        None  # [num_chunks, max_q] int64 into the chunk tokens
    )
    prefill_query_valid: torch.Tensor | None = None  # [num_chunks, max_q] bool
    prefill_mask: torch.Tensor | None = None  # [num_chunks, 1, max_q, max_ctx] bool
    prefill_query_pos: torch.Tensor | None = None  # [num_chunks, max_q] int64: absolute position
    _bias_cache: dict[tuple[int, torch.dtype, int | None], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _window_masks: dict[tuple[str, int], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _chunk_spans: list[tuple[int, int, int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _chunk_arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def num_prefills(self) -> int:
        return self.context_lens.shape[0] - self.num_decode_tokens

    @property
    def padded(self) -> bool:
        return self.prefill_mask is not None

    def decode_window_mask(self, window: int | None) -> torch.Tensor:
        """The decode mask, narrowed to the last `window` keys of each context."""
        assert self.decode_mask is not None, "built with padded=False"
        if window is None:
            return self.decode_mask
        if ("decode", window) not in self._window_masks:
            ctx = self.context_lens[: self.num_decode_tokens].to(torch.int64).view(-1, 1, 1, 1)
            key_pos = torch.arange(self.decode_mask.shape[-1]).view(1, 1, 1, -1)
            self._window_masks["decode", window] = self.decode_mask & (key_pos >= ctx - window)
        return self._window_masks["decode", window]

    def prefill_window_mask(self, window: int | None) -> torch.Tensor:
        """The chunk mask, each query narrowed to keys p - window < j <= p."""
        assert self.prefill_mask is not None, "built with padded=False"
        if window is None:
            return self.prefill_mask
        if ("chunks", window) not in self._window_masks:
            q_pos = self.prefill_query_pos.view(*self.prefill_query_pos.shape, 1)
            key_pos = torch.arange(self.prefill_mask.shape[-1]).view(1, 1, -1)
            mask = self.prefill_mask[:, 0] & (key_pos > q_pos - window)
            mask[..., 0] |= ~self.prefill_query_valid  # padding queries stay finite
            self._window_masks["chunks", window] = mask.unsqueeze(1)
        return self._window_masks["chunks", window]

    def prefill_bias(
        self, group: int, dtype: torch.dtype, window: int | None = None
    ) -> torch.Tensor:
        """The chunk mask as an additive bias, its rows repeated for `group` query heads.

        Built once per step, dtype and window and shared by every layer.
        """
        key = (group, dtype, window)
        if key not in self._bias_cache:
            mask = self.prefill_window_mask(window).repeat(1, 1, group, 1)
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._bias_cache[key] = bias.masked_fill_(~mask, float("-inf"))
        return self._bias_cache[key]

    def chunk_spans(self) -> list[tuple[int, int, int]]:
        """(first token, one past the last, tokens cached before it) of each prompt chunk.

        Read from the tensors once per step and shared by every layer.
        """
        if self._chunk_spans is None:
            starts = self.query_start_loc.tolist()
            contexts = self.context_lens.tolist()
            self._chunk_spans = [
                (starts[i], starts[i + 1], contexts[i] - (starts[i + 1] - starts[i]))
                for i in range(self.num_decode_tokens, len(contexts))
            ]
        return self._chunk_spans

    def chunk_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt chunks' first tokens, lengths and tokens cached before them.

        Three [num_chunks] int32 tensors (what the CPU prefill kernel reads), built once
        per step and shared by every layer.
        """
        if self._chunk_arrays is None:
            nd = self.num_decode_tokens
            loc = self.query_start_loc.to(torch.int32)
            starts = loc[nd:-1].contiguous()
            lens = (loc[nd + 1 :] - loc[nd:-1]).contiguous()
            cached = (self.context_lens[nd:].to(torch.int32) - lens).contiguous()
            self._chunk_arrays = (starts, lens, cached)
        return self._chunk_arrays

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
    padded: bool = True,
) -> AttentionMetadata:
    """Lay out one step. Sequences with query_len 1 must come first.

    `context_lens[i]` counts all of sequence i's tokens after this step's
    tokens are written (cached context + its query chunk). `padded=False`
    skips the torch path's padded layouts (the CUDA path reads none of them).

    Everything is computed with whole-batch tensor operations: the only
    Python loop is over sequences, to pad their block tables into one list.
    """
    n = len(query_lens)
    num_decodes = 0
    while num_decodes < n and query_lens[num_decodes] == 1:
        num_decodes += 1
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError("sequences with a single query token must come first")

    # [n, max_blocks] int64: each sequence's used blocks, zero-padded.
    used = [-(-c // block_size) for c in context_lens]
    width = max(used, default=1)
    tables = torch.tensor(
        [t[:u] + [0] * (width - u) for t, u in zip(block_tables, used, strict=True)],
        dtype=torch.int64,
    ).view(n, width)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)  # [n]
    ctx = torch.tensor(context_lens, dtype=torch.int64)  # [n]
    ends = q_lens.cumsum(0)  # [n]: one past each sequence's last token
    num_tokens = int(ends[-1]) if n else 0

    # Slot of every new token: the sequence it belongs to, its position, the
    # block holding that position. In int64 throughout (slots pass 2^31).
    owner = torch.repeat_interleave(torch.arange(n), q_lens)  # [num_tokens]
    pos = torch.arange(num_tokens) + (ctx - ends)[owner]  # ctx - q_len + index in chunk
    slots = tables[owner, pos // block_size] * block_size + pos % block_size

    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=num_decodes,
        block_tables=tables.to(torch.int32),
        context_lens=ctx.to(torch.int32),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32),
        max_query_len=max(query_lens, default=0),
        max_decode_context_len=max(context_lens[:num_decodes], default=0),
    )
    if padded:
        _add_padded_layouts(meta, q_lens, ctx, tables, used, num_decodes, block_size)
    return meta


def _add_padded_layouts(
    meta: AttentionMetadata,
    q_lens: torch.Tensor,  # [n] int64
    ctx: torch.Tensor,  # [n] int64
    tables: torch.Tensor,  # [n, max_blocks] int64, zero-padded
    used: list[int],  # blocks each sequence uses
    num_decodes: int,
    block_size: int,
) -> None:
    """The torch path's layouts: decodes and chunks each gathered to their own widths."""
    dec_width = max(used[:num_decodes], default=1)
    # Contiguous copies: every layer's gather flattens them.
    meta.decode_block_tables = tables[:num_decodes, :dec_width].contiguous()
    dec_valid = torch.arange(dec_width * block_size).view(1, -1) < ctx[:num_decodes].view(-1, 1)
    meta.decode_mask = dec_valid[:, None, None, :]

    pre_width = max(used[num_decodes:], default=1)
    pre_tables = tables[num_decodes:, :pre_width].contiguous()
    pre_ctx = ctx[num_decodes:].view(-1, 1)
    pre_q = q_lens[num_decodes:].view(-1, 1)
    key_valid = torch.arange(pre_width * block_size).view(1, -1) < pre_ctx
    max_q = int(pre_q.max()) if pre_q.numel() else 1
    q_pos = torch.arange(max_q).view(1, -1)
    query_valid = q_pos < pre_q  # [chunks, max_q]
    starts = pre_q.cumsum(0) - pre_q
    query_index = torch.where(query_valid, starts + q_pos, torch.zeros_like(q_pos))
    # Absolute position of each query; a key at position j is visible iff j <= it.
    q_abs = pre_ctx - pre_q + q_pos  # [chunks, max_q]
    key_pos = torch.arange(pre_width * block_size).view(1, 1, -1)
    mask = (key_pos <= q_abs.unsqueeze(-1)) & key_valid.unsqueeze(1)
    # Padding queries see key 0 so their (discarded) softmax stays finite.
    mask[..., 0] |= ~query_valid
    meta.prefill_block_tables = pre_tables
    meta.prefill_query_index = query_index
    meta.prefill_query_valid = query_valid
    meta.prefill_mask = mask.unsqueeze(1)
    meta.prefill_query_pos = q_abs


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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    nd = meta.num_decode_tokens
    opts = (sliding_window, logits_soft_cap, sinks)
    if not meta.num_prefills:  # the common all-decode step: no output buffer needed
        return attend_decodes(query, k_cache, v_cache, meta, scale, *opts)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = attend_decodes(query, k_cache, v_cache, meta, scale, *opts)
    out[nd:] = attend_chunks(query, k_cache, v_cache, meta, scale, *opts)
    return out


def _attend(
    q: torch.Tensor,  # [n, kv_heads, rows, d]
    k: torch.Tensor,  # [n, kv_heads, keys, d]
    v: torch.Tensor,
    mask: torch.Tensor,  # bool (True: visible) or additive bias, broadcast to [n, 1, rows, keys]
    scale: float,
    logits_soft_cap: float | None,
    row_sinks: torch.Tensor | None = None,  # [1, kv_heads, rows, 1] float32
) -> torch.Tensor:  # [n, kv_heads, rows, d]
    if logits_soft_cap is None and row_sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    is_bool = mask.dtype == torch.bool
    scores = torch.where(mask, scores, float("-inf")) if is_bool else scores + mask
    if row_sinks is None:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    sink = row_sinks.float().expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(weights, v.float()).to(q.dtype)


def attend_decodes(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the decodes' come first
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_decode_tokens, num_heads, head_dim]
    """Each decoding sequence's one query over its gathered context."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    nd = meta.num_decode_tokens
    # [nd, kv_heads, group, d]: the group's queries share their KV head.
    q = query[:nd].view(nd, num_kv_heads, group, head_dim)
    k = _gather(k_cache, meta.decode_block_tables)
    v = _gather(v_cache, meta.decode_block_tables)
    mask = meta.decode_window_mask(sliding_window)
    row_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    o = _attend(q, k, v, mask, scale, logits_soft_cap, row_sinks)
    return o.view(nd, num_heads, head_dim)


def attend_chunks(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the chunks' follow the decodes'
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens - num_decode_tokens, num_heads, head_dim]
    """Every prompt chunk in one padded, masked call over its gathered context."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    chunks = query[meta.num_decode_tokens :]
    n, max_q = meta.prefill_query_index.shape
    # [n, max_q, kv_heads, group, d] -> [n, kv_heads, group * max_q, d]
    q = chunks[meta.prefill_query_index].view(n, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group * max_q, head_dim)
    k = _gather(k_cache, meta.prefill_block_tables)
    v = _gather(v_cache, meta.prefill_block_tables)
    # [n, 1, group * max_q, max_ctx]
    manual = logits_soft_cap is not None or sinks is not None
    bias = meta.prefill_bias(group, torch.float32 if manual else query.dtype, sliding_window)
    # Rows are (head in group, query): each head's sink repeated over its queries.
    row_sinks = None
    if sinks is not None:
        row_sinks = sinks.view(num_kv_heads, group).repeat_interleave(max_q, dim=1)[None, ..., None]
    o = _attend(q, k, v, bias, scale, logits_soft_cap, row_sinks)
    # [n, kv_heads, group, max_q, d] -> [n, max_q, heads, d]
    o = o.view(n, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(n, max_q, num_heads, head_dim)
    return o[meta.prefill_query_valid]
