"""Replica count from KV-cache utilisation and the waiting queue: a pure policy and its Serve adapter.

`decide` is a pure function of one `FleetSample` (per-replica used and total
KV blocks, running and waiting counts, the running and target replica
counts), an explicit `AutoscalerState` and the time `now`; it returns the
desired replica count and the next state. `KVCacheAutoscalingPolicy` is the
thin Ray Serve 2.60 adapter: Serve calls it with an `AutoscalingContext`
every control-loop tick, it reads the replicas' `record_autoscaling_stats()`
from `ctx.aggregated_metrics` (each key averaged by Serve over
`look_back_period_s`), keeps the state in `ctx.policy_state`, and takes the
time from `ctx.current_time` (or its injected clock).

The policy, with `u` = the fleet's KV utilisation (sum of used blocks over
sum of total blocks), `w` = mean waiting requests per reporting replica,
`B` = blocks per replica (mean total), `r` = running requests per replica and
`S` = `saturated_running_fraction` (0.85) of a replica's batch limit
(`saturation_running`, else the `max_num_seqs` it reports), `c_i` = replica
i's compute use (`METRIC_COMPUTE`, Serve's mean) and `C` =
`target_compute_utilization` (0.25):

- Scale out when `u > target_kv_utilization`, `w > max_waiting_per_replica`
  (default 4), `r >= S` (a full batch: compute bound, whatever the KV
  use) or the mean `c_i > C`, and this has held for `scale_out_after_s`
  without a break: to `max(running + 1, ceil(used / (target * B)), n_S,
  n_C)`, where `n_S` is the fewest replicas that keep the running requests
  per replica under `S` and `n_C = ceil(sum c_i / C)` the fewest that carry
  the fleet's compute at `C`.
- Scale in when `u < scale_in_kv_utilization` (the lower band) and
  `w <= scale_in_waiting_per_replica` (default 1), held for
  `scale_in_after_s`: by at most `max_scale_in_step` replicas, and not below
  `ceil(used / (target * B))`, `n_S` nor `n_C`, so the fleet lands inside the
  band rather than above a target, or on a full batch; nor, with
  `scale_in_keeps_hot_cache` (the default), below `ceil((used + H) / (target *
  B))`, `H` the cached blocks a prefix lookup reused in the last minute (each
  replica's `EngineStats.num_hot_cached_blocks`): a scale-in that leaves less
  room than the cache's working set evicts prompts the traffic still reuses,
  and every request that finds its prompt gone computes it again.
- The scale-in notice: for the last `scale_in_notice_s` of the hold (at most
  its second half: a low spell's first half is not yet a decision, and under
  the notice the leaver takes no new prompts), until the scale-in is due or low
  use breaks, `Decision.leaving` says how many replicas the scale-in would
  remove were it due now. A scale-in the floors held past the hold is announced
  afresh once they let it go, and comes `scale_in_notice_s` after
  (`AutoscalerState.held_at`): every scale-in is announced that long before.
  The policy publishes the notice with its status; a router that hears it warms
  the hot prompts of the replica expected to leave on the others while it still
  serves (`routing.scale_in.scale_in_notice_plan`): its cache is what a scale-in
  loses.

Why compute use, and why 0.25. A replica's compute use is the share of time its
steps fill their token budget (`EngineStats.busy_budget_seconds`: each step's
duration times its scheduled tokens over `max_num_batched_tokens`; `ComputeMeter`
turns the counter into a rate between pushes). Long prompts on a large pool queue for
compute while KV use is low and the batch is far from full: in the simulated fleet
(H200 model, 6k-token system prompts, the rate rising 8 -> 32 QPS over two minutes
from 2 replicas) KV use read 0.2-0.4 and no request waited while the prompts'
prefills grew, until each decode step carried a prefill chunk, the running requests'
decodes slowed to one token per chunk, their blocks filled the pool within ten seconds
and p99 TTFT reached 18 s. Compute use read 0.37 half a minute before that collapse, and
0.6-0.75 at it (never 1: steps past a queue's last chunk and decode-only steps leave
part of the budget unused). A new replica serves only after its start-up, and the load
keeps growing meanwhile, so the target sits well below the collapse, and the step is
sized at once (`n_C`), not one replica per hold. Seed 0 of that run: at 0.6 the first
scale-out came at 71 s, after the collapse; at 0.35 at 39 s, and p99 TTFT still reached
2.6 s; at 0.3 at 17 s, p99 0.29 s over the run; at 0.25 at 14-17 s on three seeds, p99
0.23 s, and the p99 of the minute after each scale-out at most 0.14 s above the minute
before (BENCHMARKS.md). The scale-in floor counts it too, so a scale-in never lands
above the target. It is the token budget's use, which tracks FLOPs: a decode-bound
replica (many sequences, short prompts; 32 of them on a CPU replica read 0.02-0.13)
reads low however busy it is, and there the batch and KV signals act.

Used blocks and running requests are read as the `kv_utilization_quantile`
(0.9) of each replica's points over the look-back window (Serve's raw time
series; `sample_from_context`), not Serve's mean of them: a replica whose
users run in lock-step fills its cache to 0.9 and empties it as each wave
of requests finishes, and the mean (0.5-0.7 there) hides the peak that
the next wave hits again. Waiting requests are Serve's mean (below).
- Otherwise hold the current target (replicas still starting are kept).
- Never below `ceil(used / B)`, the replicas the running requests' blocks
  need, and always within [min_replicas, max_replicas].

Why the waiting thresholds. `w` is Serve's time-weighted mean over
`look_back_period_s` (below), so one push of `k` waiting requests reads as
`k * metrics_interval_s / look_back_period_s` for a whole look-back window,
longer than `scale_out_after_s`: at a threshold of 0, a single request that
waited for one push (one prefill step's queue, at 30% KV use) would scale
1 -> 2, and the idle replica would be scaled in a minute later. So a replica
is added only while several requests per replica wait. The band between the two
levels is the hysteresis: a one-replica scale-in (`max_scale_in_step` 1)
from n to n - 1 replicas multiplies `w` by n / (n - 1), at most 2, so a fleet
scaled in at `w <= 1` sees `w <= 2` afterwards, still under the scale-out
level of 4.

The hold timers restart whenever the running replica count changes: a scale
step is judged on the fleet it produced, not on readings from before it. The
desired count is computed from the running replicas, so repeating a decision
while new replicas start does not compound.

On top of this Serve applies its own machinery to whatever the policy returns
(`ray.serve.autoscaling_policy._apply_autoscaling_config` in 2.60):
`upscaling_factor` / `downscaling_factor`, then `upscale_delay_s` /
`downscale_delay_s` (the desired direction must persist that long before the
target changes), then min/max bounds; and it averages each metric over
`look_back_period_s`. `serve_autoscaling_config` sets those from this config:
the delays default to 0 because the policy's own hold times already do that
job (nonzero values add to them), the look-back defaults to 15 s, and the
replicas push their stats every `metrics_interval_s` (2 s; Serve's default
is 10 s).

This module must stay importable without torch: Serve's controller imports it
to run the policy, so it touches no `pagefleet.engine` module.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pagefleet.settings import check_settings, setting

logger = logging.getLogger("pagefleet.cluster")

# Keys of the dict a replica returns from `record_autoscaling_stats()` (values
# must be int or float: Serve 2.60 disables custom metrics otherwise).
METRIC_KV_USED_BLOCKS = "pagefleet_kv_used_blocks"
METRIC_KV_TOTAL_BLOCKS = "pagefleet_kv_total_blocks"
METRIC_RUNNING = "pagefleet_num_running"
METRIC_WAITING = "pagefleet_num_waiting"
METRIC_MAX_NUM_SEQS = "pagefleet_max_num_seqs"  # the replica's batch limit (its config)
METRIC_KV_HOT_BLOCKS = "pagefleet_kv_hot_blocks"  # cached blocks reused in the last minute
# The share of the last push interval the engine spent on its steps' token budget
# (`ComputeMeter` over `EngineStats.busy_budget_seconds`): 1 is prefill-bound.
METRIC_COMPUTE = "pagefleet_compute_utilization"

# Our keys in Serve's per-deployment `policy_state` (Serve adds its own).
_STATE_HIGH_SINCE = "pagefleet.high_since"
_STATE_LOW_SINCE = "pagefleet.low_since"
_STATE_REPLICAS = "pagefleet.replicas"
_STATE_HELD_AT = "pagefleet.held_at"


@dataclass(frozen=True)
class AutoscalingPolicyConfig:
    """Autoscaler settings; frozen and checked on construction.

    Each field's default, range and description are declared once, here
    (`pagefleet.settings.setting`); the serving config's `autoscaling:`
    (`pagefleet.cluster.config.AutoscalingSettings`) is built from these
    fields. `__post_init__` checks the declared ranges, then what spans
    fields (the replica bounds, the two bands).

    `upscale_delay_s`, `downscale_delay_s` and `look_back_period_s` are not
    read by `decide`; they configure Serve's `AutoscalingConfig`
    (`serve_autoscaling_config`), which applies them on top of the policy.
    """

    min_replicas: int = setting(1, "fewest engine replicas", ge=0)
    max_replicas: int = setting(4, "most engine replicas", ge=1)
    initial_replicas: int | None = setting(
        None, "replicas at deploy time (within [min_replicas, max_replicas])", ge=0
    )
    target_kv_utilization: float = setting(
        0.75, "scale out above this mean KV use (0-1)", gt=0, le=1
    )
    scale_in_kv_utilization: float = setting(
        0.40, "scale in below this mean KV use (0-1, < target_kv_utilization)", ge=0, lt=1
    )
    max_waiting_per_replica: float = setting(
        4.0,
        "scale out while more requests than this wait per replica (Serve's mean)",
        ge=0,
    )
    scale_in_waiting_per_replica: float = setting(
        1.0,
        "scale in only while at most this many wait per replica (<= max_waiting_per_replica)",
        ge=0,
    )
    kv_utilization_quantile: float = setting(
        0.9,
        "read a replica's KV use and running requests as this quantile of its samples over "
        "look_back_period_s (1: the peak), not their mean, so lock-step waves do not average away",
        gt=0,
        le=1,
    )
    saturated_running_fraction: float = setting(
        0.85,
        "scale out while running requests per replica reach this fraction of its batch limit "
        "(saturation_running, or its max_num_seqs), whatever the KV use",
        gt=0,
        le=1,
    )
    target_compute_utilization: float = setting(
        0.25,
        "scale out above this mean compute use: the share of time a replica's steps fill "
        "their token budget (0-1; 1: off). Below 1 by the margin the load may grow while a "
        "new replica starts",
        gt=0,
        le=1,
    )
    saturation_running: int | None = setting(
        None,
        "a replica's batch limit in running requests: where more no longer adds throughput "
        "(measured); None: its engine.max_num_seqs",
        ge=1,
    )
    scale_out_after_s: float = setting(10.0, "how long high use must last", ge=0)
    scale_in_after_s: float = setting(60.0, "how long low use must last", ge=0)
    scale_in_notice_s: float = setting(
        20.0,
        "announce a scale-in this long before it is due (at most scale_in_after_s / 2), so "
        "the routers can warm the leaving replica's hot prompts on the others while it "
        "still serves (0: no notice)",
        ge=0,
    )
    max_scale_in_step: int = setting(1, "replicas removed per decision at most", ge=1)
    scale_in_keeps_hot_cache: bool = setting(
        True,
        "scale in only as far as the replicas left hold the running requests' blocks and "
        "the cached blocks reused in the last minute at target_kv_utilization",
    )
    upscale_delay_s: float = setting(0.0, "Serve's upscale delay, on top", ge=0)
    downscale_delay_s: float = setting(0.0, "Serve's downscale delay, on top", ge=0)
    look_back_period_s: float = setting(15.0, "Serve's metrics look-back window", gt=0)
    metrics_interval_s: float = setting(
        2.0,
        "how often replicas push their KV stats to Serve's controller (<= look_back_period_s)",
        gt=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= 1 and >= min_replicas "
                f"({self.min_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must be within [min_replicas, max_replicas]")
        if not self.scale_in_kv_utilization < self.target_kv_utilization:
            raise ValueError(
                "scale_in_kv_utilization (the lower band) must be in [0, target_kv_utilization)"
            )
        if not self.scale_in_waiting_per_replica <= self.max_waiting_per_replica:
            raise ValueError(
                "scale_in_waiting_per_replica (the lower level) must be in "
                "[0, max_waiting_per_replica]"
            )
        if not self.metrics_interval_s <= self.look_back_period_s:
            raise ValueError("metrics_interval_s must be in (0, look_back_period_s]")

    def policy_kwargs(self) -> dict[str, Any]:
        """JSON-serializable kwargs that rebuild this config (Serve's `policy_kwargs`)."""
        return asdict(self)


@dataclass(frozen=True)
class ReplicaKV:
    used_blocks: float
    total_blocks: float
    running: float = 0.0
    waiting: float = 0.0
    max_num_seqs: float = 0.0  # its batch limit; 0: not reported (no saturation signal)
    hot_blocks: float = 0.0  # cached blocks reused in the last minute (in use or not)
    compute: float = 0.0  # compute use, 0-1 (`METRIC_COMPUTE`; 0: not reported)


@dataclass(frozen=True)
class FleetSample:
    """What one tick sees. `replicas` holds only replicas that reported metrics."""

    running_replicas: int
    target_replicas: int
    replicas: Mapping[str, ReplicaKV]


@dataclass(frozen=True)
class AutoscalerState:
    high_since: float | None = None  # since when scale-out has been wanted
    low_since: float | None = None  # since when scale-in has been wanted
    replicas: int | None = None  # running replicas the timers were started on
    # The last tick at which a scale-in within the notice would have removed nothing (the
    # floors held it): a later one is announced afresh, `scale_in_notice_s` from then.
    held_at: float | None = None

    @classmethod
    def from_policy_state(cls, policy_state: Mapping[str, Any]) -> AutoscalerState:
        return cls(
            policy_state.get(_STATE_HIGH_SINCE),
            policy_state.get(_STATE_LOW_SINCE),
            policy_state.get(_STATE_REPLICAS),
            policy_state.get(_STATE_HELD_AT),
        )

    def to_policy_state(self) -> dict[str, Any]:
        return {
            _STATE_HIGH_SINCE: self.high_since,
            _STATE_LOW_SINCE: self.low_since,
            _STATE_REPLICAS: self.replicas,
            _STATE_HELD_AT: self.held_at,
        }


@dataclass(frozen=True)
class Decision:
    replicas: int
    state: AutoscalerState
    reason: str
    kv_utilization: float | None = None
    # The scale-in notice: replicas a scale-in will remove once low use has held for
    # `scale_in_after_s` (announced `scale_in_notice_s` before, at most half of it; 0: none).
    leaving: int = 0
    compute_utilization: float | None = None  # the replicas' mean compute use it read


def decide(
    sample: FleetSample, state: AutoscalerState, config: AutoscalingPolicyConfig, now: float
) -> Decision:
    """The desired replica count for `sample` (module docstring), and the next state."""

    def bounded(n: int) -> int:
        return max(config.min_replicas, min(config.max_replicas, n))

    running = sample.running_replicas
    if running != state.replicas:  # a new fleet: judge it afresh
        state = AutoscalerState(replicas=running)
    reports = [r for r in sample.replicas.values() if r.total_blocks > 0]
    if not reports:
        return Decision(
            bounded(sample.target_replicas), AutoscalerState(replicas=running), "no metrics"
        )

    used = sum(r.used_blocks for r in reports)
    hot = sum(r.hot_blocks for r in reports) if config.scale_in_keeps_hot_cache else 0.0
    total = sum(r.total_blocks for r in reports)
    waiting = sum(r.waiting for r in reports) / len(reports)  # per replica
    per_replica = total / len(reports)
    util = used / total
    at_target = math.ceil(used / (config.target_kv_utilization * per_replica) - 1e-9)
    need = math.ceil(used / per_replica - 1e-9)  # what the running requests' blocks occupy
    # What a scale-in leaves room for: the running requests' blocks and the hot cache
    # (its blocks in use are counted twice: a little more room, never less).
    at_hot = math.ceil((used + hot) / (config.target_kv_utilization * per_replica) - 1e-9)

    # Compute bound: as many running requests per replica as its batch takes (a full batch
    # at low KV use: short requests, or lock-step waves between their peaks).
    limits = [(r.running, config.saturation_running or r.max_num_seqs) for r in reports]
    limits = [(n, limit) for n, limit in limits if limit > 0]
    saturated, at_saturation = False, 0
    if limits:
        level = config.saturated_running_fraction * sum(lim for _, lim in limits) / len(limits)
        busy = sum(n for n, _ in limits)
        saturated = busy / len(limits) >= level
        # The fewest replicas that keep each under the level (at it, one would scale out).
        at_saturation = math.floor(busy / level) + 1 if busy > 0 else 0

    # Compute bound: prompts queue for compute long before their blocks fill the cache
    # (a large pool, short outputs). The fewest replicas that carry the fleet's compute
    # at the target: sized at once, not one replica per hold, since each takes a start-up.
    compute = sum(r.compute for r in reports)
    busy_compute, at_compute = False, 0
    if config.target_compute_utilization < 1:  # 1: off
        busy_compute = compute / len(reports) > config.target_compute_utilization
        at_compute = math.ceil(compute / config.target_compute_utilization - 1e-9)

    high = (
        util > config.target_kv_utilization
        or waiting > config.max_waiting_per_replica
        or saturated
        or busy_compute
    )
    # Below both lower levels: the gaps to the scale-out levels keep a scale-in from
    # producing a fleet that scales out again.
    low = util < config.scale_in_kv_utilization and waiting <= config.scale_in_waiting_per_replica
    target = sample.target_replicas
    leaving = 0
    if high:
        since = state.high_since if state.high_since is not None else now
        next_state = AutoscalerState(high_since=since, replicas=running)
        if now - since >= config.scale_out_after_s:
            desired = max(target, running + 1, at_target, at_saturation, at_compute)
            reason = "scale out"
        else:
            desired, reason = target, "high, holding"
    elif low:
        since = state.low_since if state.low_since is not None else now
        keep = max(running - config.max_scale_in_step, at_target, at_saturation, at_hot, at_compute)
        # What a scale-in would remove were it due now.
        going = max(0, running - bounded(max(min(target, keep), need)))
        notice = min(config.scale_in_notice_s, config.scale_in_after_s / 2)
        held_at = state.held_at
        if not going and now - since >= config.scale_in_after_s - notice:
            held_at = now  # a later scale-in is announced afresh
        next_state = AutoscalerState(low_since=since, replicas=running, held_at=held_at)
        heard = held_at is None or now - held_at >= notice
        if now - since >= config.scale_in_after_s and going and heard:
            desired, reason = min(target, keep), "scale in"
        else:
            desired = target
            if now - since < config.scale_in_after_s - notice:
                reason = "low, holding"
            elif going:
                reason, leaving = "low, scale-in announced", going
            else:
                reason = f"low, scale-in held at {keep}"
    else:
        next_state, desired, reason = AutoscalerState(replicas=running), target, "in band"
    if need > desired:
        desired, reason = need, f"{reason}; floor: running requests need {need}"
    return Decision(bounded(desired), next_state, reason, util, leaving, compute / len(reports))


def _replica_key(replica_id: Any) -> str:
    return str(getattr(replica_id, "unique_id", replica_id))


def window_quantile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (1: the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered) - 1e-9) - 1)]


def sample_from_context(ctx: Any, quantile: float | None = None) -> FleetSample:
    """Read a Serve 2.60 `AutoscalingContext` (duck-typed: fakes in tests).

    With `quantile`, a replica's used blocks and running requests are that quantile of the
    samples in Serve's raw time series (`ctx.raw_metrics`: what the replica recorded over
    the look-back window, one point per record interval) rather than Serve's mean over it:
    a replica whose KV use swings 0.9 -> 0 -> 0.9 as lock-step waves of requests start and
    finish together reads 0.9, not 0.5. Waiting requests, and any series missing from
    `raw_metrics`, are Serve's mean (`ctx.aggregated_metrics`)."""
    metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
    raw: Mapping[str, Mapping[Any, Any]] = (
        (getattr(ctx, "raw_metrics", None) or {}) if quantile is not None else {}
    )

    def read(key: str, rid: Any) -> float:
        series = raw.get(key, {}).get(rid)
        if series:
            return float(window_quantile([p.value for p in series], quantile or 1.0))
        return float(metrics.get(key, {}).get(rid, 0.0))

    used = metrics.get(METRIC_KV_USED_BLOCKS, {})
    total = metrics.get(METRIC_KV_TOTAL_BLOCKS, {})
    replicas = {
        _replica_key(rid): ReplicaKV(
            used_blocks=read(METRIC_KV_USED_BLOCKS, rid),
            total_blocks=float(total[rid]),
            running=read(METRIC_RUNNING, rid),
            waiting=float(metrics.get(METRIC_WAITING, {}).get(rid, 0.0)),
            max_num_seqs=float(metrics.get(METRIC_MAX_NUM_SEQS, {}).get(rid, 0.0)),
            hot_blocks=read(METRIC_KV_HOT_BLOCKS, rid),
            compute=float(metrics.get(METRIC_COMPUTE, {}).get(rid, 0.0)),
        )
        for rid in total
        if rid in used
    }
    return FleetSample(ctx.current_num_replicas, ctx.target_num_replicas, replicas)


@dataclass(frozen=True)
class AutoscalerStatus:
    """What the policy last acted on, for `pagefleet:replicas`, `pagefleet:target_replicas`,
    `pagefleet:autoscaler_kv_utilization` and `pagefleet:autoscaler_compute_utilization`
    (the ingress exports them)."""

    replicas: int  # running replicas when the policy ran
    target_replicas: int  # what it asked for
    kv_utilization: float | None  # the fleet utilisation it acted on (None: no metrics yet)
    time: float
    leaving: int = 0  # the scale-in notice (`Decision.leaving`): replicas about to be removed
    compute_utilization: float | None = None  # the mean compute use it acted on

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> AutoscalerStatus:
        return cls(**json.loads(data))


def status_key(app_name: str | None, deployment_name: str) -> bytes:
    """Where the policy publishes its status in Ray's internal key-value store."""
    return f"pagefleet/autoscaler/{app_name or ''}/{deployment_name}".encode()


def publish_status(key: bytes, status: AutoscalerStatus) -> None:
    """Best effort: the policy runs in Serve's controller, the ingress reads it back (GCS)."""
    from ray.experimental import internal_kv  # only where Ray runs

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(key, status.to_json(), overwrite=True)


def read_status(key: bytes) -> AutoscalerStatus | None:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    data = internal_kv._internal_kv_get(key)
    return AutoscalerStatus.from_json(data) if data else None


class KVCacheAutoscalingPolicy:
    """Serve 2.60 class-callable policy: `AutoscalingPolicy(policy_function=KVCacheAutoscalingPolicy,
    policy_kwargs=config.policy_kwargs())`. Serve instantiates it once with the kwargs
    and calls it every tick; it returns (desired replicas, policy state), and
    publishes an `AutoscalerStatus` through `publish` (Ray's key-value store by default)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        publish: Callable[[bytes, AutoscalerStatus], None] | None = publish_status,
        **kwargs: Any,
    ) -> None:
        self.config = AutoscalingPolicyConfig(**kwargs)
        self._clock = clock
        self._publish = publish

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else self._clock()
        state = AutoscalerState.from_policy_state(ctx.policy_state or {})
        sample = sample_from_context(ctx, self.config.kv_utilization_quantile)
        decision = decide(sample, state, self.config, now)
        if self._publish is not None:
            status = AutoscalerStatus(
                ctx.current_num_replicas,
                decision.replicas,
                decision.kv_utilization,
                now,
                decision.leaving,
                decision.compute_utilization,
            )
            try:
                self._publish(status_key(ctx.app_name, ctx.deployment_name), status)
            except Exception:  # metrics must never stop the control loop
                logger.warning("could not publish the autoscaler status", exc_info=True)
        return decision.replicas, decision.state.to_policy_state()


class ComputeMeter:
    """A replica's compute use between its autoscaling pushes: the rate of
    `EngineStats.busy_budget_seconds` over the time since the last reading, in [0, 1]
    (0 at the first reading: no interval yet)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (time, busy seconds)

    def read(self, busy_seconds: float, now: float) -> float:
        last, self._last = self._last, (now, busy_seconds)
        if last is None or now <= last[0]:
            return 0.0
        return min(1.0, max(0.0, (busy_seconds - last[1]) / (now - last[0])))


def autoscaling_stats_from_engine(
    stats: Any, max_num_seqs: int, compute: float = 0.0
) -> dict[str, float]:
    """What a replica returns from `record_autoscaling_stats()`, from its `EngineStats`, its
    engine's `max_num_seqs` and its compute use since its last push (`ComputeMeter`)."""
    return {
        METRIC_KV_USED_BLOCKS: float(stats.num_total_blocks - stats.num_free_blocks),
        METRIC_KV_TOTAL_BLOCKS: float(stats.num_total_blocks),
        METRIC_RUNNING: float(stats.num_running),
        METRIC_WAITING: float(stats.num_waiting),
        METRIC_MAX_NUM_SEQS: float(max_num_seqs),
        METRIC_KV_HOT_BLOCKS: float(stats.num_hot_cached_blocks),
        METRIC_COMPUTE: float(compute),
    }


def serve_autoscaling_config(config: AutoscalingPolicyConfig) -> Any:
    """Serve's `AutoscalingConfig` running this policy, with Serve's own knobs from `config`."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy  # only where Serve runs

    return AutoscalingConfig(
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        initial_replicas=config.initial_replicas,
        upscale_delay_s=config.upscale_delay_s,
        downscale_delay_s=config.downscale_delay_s,
        look_back_period_s=config.look_back_period_s,
        # How often replicas push `record_autoscaling_stats` to the controller (Serve's
        # default, 10 s, would make the policy act on readings that old).
        metrics_interval_s=config.metrics_interval_s,
        policy=AutoscalingPolicy(
            policy_function=KVCacheAutoscalingPolicy, policy_kwargs=config.policy_kwargs()
        ),
    )
