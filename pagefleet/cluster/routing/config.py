"""The router's settings (`RoutingConfig`) and the policies a config may name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagefleet.settings import check_settings, setting

RoutingPolicyName = Literal[
    "most_free_blocks", "power_of_two", "round_robin", "prefix_cache_affinity"
]
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicyName)
# How often Serve polls each replica's `record_routing_stats` (its
# `request_routing_stats_period_s`), unless the config says otherwise.
DEFAULT_ROUTING_STATS_PERIOD_S = 2.0


@dataclass(frozen=True)
class RoutingConfig:
    """Router settings; frozen and checked on construction.

    Each field's default, range and description are declared once, here
    (`pagefleet.settings.setting`); the serving config's `routing:` key is
    `policy` (`pagefleet.cluster.config.ServeConfig.routing`); the other
    fields are its `router:` key, and reach a `most_free_blocks` router as
    Serve's `request_router_kwargs` (`serve_routers.request_router_config`).

    `stats_include_slack_s`: how long after a request is sent a replica's
    report is trusted to include it (transit and clock skew between router
    and replica). `max_in_flight_age_s`: a reservation older than this is
    ignored even if its completion was never seen (a safety net, not a
    timeout on requests). The affinity settings (`affinity_max_load_gap`,
    `affinity_max_waiting_gap`: the cap; `affinity_owner_weight`: free blocks
    an owned prompt block is worth; `affinity_memory_blocks`: prompt block
    hashes `RouterState.owners` remembers, least recently sent dropped first;
    `new_prompt_kept_weight`: what a new prompt is charged for the prompt blocks a
    replica keeps),
    `memory_headroom` (the free blocks a score counts at most) and
    `prefill_rate_window` (the backlog's drain between reports, `prefill_drain`)
    are explained in the module docstring; `shared_view_period_s` and
    `shared_view_timeout_s` (the exchanges between ingress replicas' routers) in
    `shared_view`'s.
    """

    policy: RoutingPolicyName = setting(  # noqa: RUF009 (a dataclasses.Field, like field())
        "most_free_blocks",
        "how requests pick a replica: most free KV blocks after placing the request "
        "(prefix-cache aware), or Serve's power-of-two / round robin for comparison",
        choices=ROUTING_POLICIES,
    )
    affinity_max_load_gap: float = setting(
        1.0,
        "prefix hits count only on a replica whose load is within this of the least loaded's",
        ge=0,
        le=1,
    )
    affinity_max_waiting_gap: int = setting(
        8,
        "prefix hits count only on a replica whose waiting queue is within this of the shortest's",
        ge=0,
    )
    stats_include_slack_s: float = setting(
        1.0, "how long after a request is sent a replica's report includes it", ge=0
    )
    max_in_flight_age_s: float = setting(
        600.0, "a reservation older than this is dropped, its completion unseen", gt=0
    )
    affinity_memory_blocks: int = setting(
        65536,
        "prompt block hashes whose owner the router remembers, at least (more for a fleet "
        "whose caches hold more: as many as they hold, up to affinity_memory_max_blocks)",
        ge=0,
    )
    affinity_memory_max_blocks: int = setting(
        1 << 20,
        "the most prompt block hashes the router's owner memory grows to with the fleet "
        "(about 130 bytes each)",
        ge=0,
    )
    affinity_owner_weight: float = setting(
        4.0, "free blocks each prompt block on its owner is worth", ge=0
    )
    new_prompt_kept_weight: float = setting(
        1.0,
        "free blocks each prompt block a replica keeps for later requests (the blocks last "
        "sent there, at most its pool) costs a prompt no replica holds yet",
        ge=0,
    )
    prefill_weight: float = setting(
        1.0,
        "free blocks each block of a replica's prefill backlog (prompt tokens it has still "
        "to compute, reported plus sent since) costs its score",
        ge=0,
    )

    prefill_rate_window: int = setting(
        8,
        "reports over which a replica's prefill rate is its best throughput, to drain its "
        "backlog between reports (0: no drain; a prompt sent counts until a report has it)",
        ge=0,
    )
    memory_headroom: float = setting(
        0.5,
        "free blocks count in a score in full only up to this fraction of the replica's pool",
        gt=0,
        le=1,
    )
    headroom_block_weight: float = setting(
        0.125,
        "what each free block past memory_headroom counts in a score (1: as much as any)",
        ge=0,
        le=1,
    )
    shared_view_period_s: float = setting(
        0.1,
        "how often each router exchanges its sends and prompt owners with the other "
        "ingress replicas' routers (0: each routes on its own view; with one ingress "
        "replica there is no peer and no exchange)",
        ge=0,
    )
    shared_view_timeout_s: float = setting(
        1.0,
        "an exchange not answered within this leaves the router on its own view until one is",
        gt=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)
