from __future__ import annotations

import bisect
from dataclasses import dataclass

# vLLM's vllm:iteration_tokens_total bounds: tokens one engine step scheduled.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def iteration_bucket(num_tokens: int) -> int:
    """The index of the first bound of ITERATION_TOKEN_BUCKETS that holds num_tokens
    (len(ITERATION_TOKEN_BUCKETS) beyond the last)."""
    return bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's load; what the router and autoscaler read."""

    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found cached
    num_cached_blocks: int = 0
    # Hashes of cached blocks (bounded): a router can prefer the replica that
    # already holds a prompt's prefix by hashing the prompt's blocks the same way.
    cached_block_hashes: frozenset[int] = frozenset()
    # The same set as a bounded Bloom bitset (`prefix_hash.DigestView`), kept
    # incrementally: what a replica reports to the router every few seconds.
    prefix_digest: bytes = b""
    # Root of this engine's hash chains (`prefix_hash.prefix_hash_salt(model, block_size)`).
    prefix_hash_salt: int = 0
    # Blocks the unfinished requests (running and waiting) will still allocate
    # if each runs to its max_tokens: free blocks alone hide a replica whose
    # long requests have most of their output still to write.
    num_demand_blocks: int = 0
    # Structured outputs (`GrammarCompiler`): grammars compiled and the seconds that took,
    # and requests whose grammar was already compiled or compiling (hits) or not (misses).
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    # Prompt tokens the unfinished requests must still compute before each samples
    # (a prompt mid chunked prefill, a waiting prompt less its cached prefix, a
    # preempted sequence's recompute): the replica's compute backlog, which free
    # blocks do not show on a large pool.
    num_prefill_tokens: int = 0
    # Cached blocks a prefix lookup reused in the last minute, in use or not
    # (`BlockManager.num_hot_cached_blocks`): the cache's working set, which the
    # autoscaler keeps room for when it scales in.
    num_hot_cached_blocks: int = 0
    # Seconds of steps, each weighted by the share of its token budget
    # (max_num_batched_tokens) it scheduled (a counter): its rate is the replica's compute
    # use, 1 when every moment is a full-budget step (prefill-bound), near 0 when idle
    # or decoding a few sequences. What the autoscaler reads as compute saturation, which
    # neither KV use nor the batch shows while prompts queue for compute.
    busy_budget_seconds: float = 0.0
    # Steps by the tokens each scheduled: a count per bucket of ITERATION_TOKEN_BUCKETS
    # (`iteration_bucket`; one more for beyond the last, not cumulative), and the tokens
    # of all steps (counters; vLLM's iteration_tokens_total histogram).
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0-1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_total_blocks
