"""The KV-cache block pool.

Owns one invariant: every block is either free (ref count 0, in the free
list) or used (ref count >= 1, in at least one sequence's block table), so
`num_free_blocks + num_used_blocks == num_total_blocks` always holds.

A sequence's block table grows only when its last block is full: slots for
`n` tokens need ceil(n / block_size) blocks. Allocation is all-or-nothing, so a
failed request for blocks changes nothing.

Free blocks are handed out from the front of the free list and returned to its
back, a sequence's blocks in reverse order (its tail first). That order is
what least-recently-used eviction of cached prefix blocks will need.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_total_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must add so that its table holds `num_tokens` slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s table to hold `num_tokens` slots; False (and no change) if short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block_id = self._free.popleft()
            self._ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; a block returns to the pool when no one holds it."""
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        seq.block_table.clear()

    def check_accounting(self) -> None:
        """Raise AssertionError unless free + used == total and ref counts agree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free list twice")
        for block_id, count in enumerate(self._ref_counts):
            if (count == 0) != (block_id in free):
                raise AssertionError(
                    f"block {block_id}: ref count {count} but free={block_id in free}"
                )
            if count < 0:
                raise AssertionError(f"block {block_id}: negative ref count {count}")
