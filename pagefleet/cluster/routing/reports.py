"""What each replica reports to the routers (`record_routing_stats`), and the router's
parsed view of it (`ReplicaLoad`)."""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from pagefleet.engine import DigestView, EngineStats

# Keys of the dict a replica returns from `record_routing_stats` (the contract
# between replica.py and this module; `routing_stats_from_engine` builds it).
STAT_FREE_BLOCKS = "free_blocks"  # int: KV blocks free (free-but-cached ones count as free)
STAT_TOTAL_BLOCKS = "total_blocks"  # int
STAT_BLOCK_SIZE = "block_size"  # int: tokens per block
STAT_RUNNING = "running"  # int: sequences scheduled
STAT_WAITING = "waiting"  # int: requests queued, not yet admitted
STAT_DEMAND_BLOCKS = "demand_blocks"  # int, optional: EngineStats.num_demand_blocks
STAT_PREFILL_TOKENS = "prefill_tokens"  # int, optional: EngineStats.num_prefill_tokens
STAT_PREFILL_DONE = "prefill_done"  # int, optional: EngineStats.prompt_tokens_total (a counter)
STAT_PREFIX_DIGEST = "prefix_digest"  # bytes, optional: EngineStats.prefix_digest
STAT_HASH_SALT = "hash_salt"  # int, optional: EngineStats.prefix_hash_salt
STAT_TIMESTAMP = "timestamp"  # float: time.time() on the replica when the snapshot was taken


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's latest report, as the router sees it.

    `reported` is False for a replica with no report yet (the other numbers
    are then placeholders and the policy assumes it empty).
    """

    replica_id: str
    free_blocks: int
    total_blocks: int
    block_size: int
    running: int = 0
    waiting: int = 0
    prefix_digest: Container[int] = frozenset()
    timestamp: float = 0.0
    hash_salt: int | None = None
    demand_blocks: int = 0
    prefill_tokens: int = 0
    prefill_done: int = 0
    reported: bool = True

    def __post_init__(self) -> None:
        if self.reported and (self.total_blocks < 1 or self.block_size < 1):
            raise ValueError(f"{self.replica_id}: total_blocks and block_size must be >= 1")
        if not 0 <= self.free_blocks <= max(self.total_blocks, 0):
            raise ValueError(f"{self.replica_id}: free_blocks must be in [0, total_blocks]")

    @classmethod
    def unreported(cls, replica_id: str) -> ReplicaLoad:
        return cls(replica_id, 0, 0, 1, reported=False)

    @classmethod
    def from_routing_stats(cls, replica_id: str, stats: Mapping[str, Any] | None) -> ReplicaLoad:
        """Parse what `record_routing_stats` returned; `unreported` if empty or unusable."""
        if not stats or STAT_TOTAL_BLOCKS not in stats:
            return cls.unreported(replica_id)
        digest_bytes = stats.get(STAT_PREFIX_DIGEST)
        digest: Container[int] = frozenset()
        if digest_bytes:
            try:
                digest = DigestView(bytes(digest_bytes))
            except ValueError:
                digest = frozenset()  # a digest we cannot read is no digest, not an error
        try:
            return cls(
                replica_id=replica_id,
                free_blocks=int(stats[STAT_FREE_BLOCKS]),
                total_blocks=int(stats[STAT_TOTAL_BLOCKS]),
                block_size=int(stats[STAT_BLOCK_SIZE]),
                running=int(stats.get(STAT_RUNNING, 0)),
                waiting=int(stats.get(STAT_WAITING, 0)),
                demand_blocks=int(stats.get(STAT_DEMAND_BLOCKS, 0)),
                prefill_tokens=int(stats.get(STAT_PREFILL_TOKENS, 0)),
                prefill_done=int(stats.get(STAT_PREFILL_DONE, 0)),
                prefix_digest=digest,
                hash_salt=stats.get(STAT_HASH_SALT),
                timestamp=float(stats.get(STAT_TIMESTAMP, 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            return cls.unreported(replica_id)


def routing_stats_from_engine(stats: EngineStats, now: float) -> dict[str, Any]:
    """The dict a replica returns from `record_routing_stats` (`now`: its time.time())."""
    return {
        STAT_FREE_BLOCKS: stats.num_free_blocks,
        STAT_TOTAL_BLOCKS: stats.num_total_blocks,
        STAT_BLOCK_SIZE: stats.block_size,
        STAT_RUNNING: stats.num_running,
        STAT_WAITING: stats.num_waiting,
        STAT_DEMAND_BLOCKS: stats.num_demand_blocks,
        STAT_PREFILL_TOKENS: stats.num_prefill_tokens,
        STAT_PREFILL_DONE: stats.prompt_tokens_total,
        STAT_PREFIX_DIGEST: stats.prefix_digest,
        STAT_HASH_SALT: stats.prefix_hash_salt,
        STAT_TIMESTAMP: now,
    }
