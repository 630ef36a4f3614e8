from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0-1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_total_blocks
