"""The KV-cache autoscaler: pure decisions over time, and the Serve adapter with fake contexts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from pagefleet.cluster.autoscaling import (
    METRIC_COMPUTE,
    METRIC_KV_HOT_BLOCKS,
    METRIC_KV_TOTAL_BLOCKS,
    METRIC_KV_USED_BLOCKS,
    METRIC_MAX_NUM_SEQS,
    METRIC_RUNNING,
    METRIC_WAITING,
    AutoscalerState,
    AutoscalerStatus,
    AutoscalingPolicyConfig,
    ComputeMeter,
    FleetSample,
    KVCacheAutoscalingPolicy,
    ReplicaKV,
    autoscaling_stats_from_engine,
    decide,
    sample_from_context,
    window_quantile,
)
from pagefleet.engine.stats import EngineStats

CFG = AutoscalingPolicyConfig(
    min_replicas=1,
    max_replicas=6,
    target_kv_utilization=0.75,
    scale_in_kv_utilization=0.4,
    scale_out_after_s=10.0,
    scale_in_after_s=30.0,
)


def fleet(
    used: list[float],
    waiting: list[float] | None = None,
    target: int | None = None,
    total: float = 100.0,
) -> FleetSample:
    waiting = waiting or [0.0] * len(used)
    reps = {
        f"r{i}": ReplicaKV(u, total, 1.0, w)
        for i, (u, w) in enumerate(zip(used, waiting, strict=True))
    }
    return FleetSample(len(used), target if target is not None else len(used), reps)


def run(
    samples: list[tuple[float, FleetSample]], config: AutoscalingPolicyConfig = CFG
) -> list[int]:
    """Feed (time, sample) pairs through `decide`, threading the state; the replica counts."""
    state, out = AutoscalerState(), []
    for now, sample in samples:
        d = decide(sample, state, config, now)
        state = d.state
        out.append(d.replicas)
    return out


def test_scales_out_only_after_sustained_high_utilisation() -> None:
    high = fleet([90, 80])  # u = 0.85 > 0.75
    assert run([(0.0, high), (5.0, high), (9.9, high), (10.0, high)]) == [2, 2, 2, 3]
    # ceil(170 / 75) = 3: one more replica brings the fleet to the target.
    d = decide(high, AutoscalerState(high_since=0.0, replicas=2), CFG, 10.0)
    assert (d.replicas, d.reason, d.kv_utilization) == (3, "scale out", 0.85)


def test_a_dip_restarts_the_hold_timer() -> None:
    high, mid = fleet([90, 80]), fleet([60, 60])
    assert run([(0.0, high), (8.0, mid), (9.0, high), (18.0, high), (19.0, high)]) == [
        2,
        2,
        2,
        2,
        3,
    ]


def test_scale_out_size_follows_utilisation() -> None:
    full = fleet([100, 100, 100])  # ceil(300 / 75) = 4
    d = decide(full, AutoscalerState(high_since=0.0, replicas=3), CFG, 20.0)
    assert d.replicas == 4
    d = decide(fleet([100] * 5), AutoscalerState(high_since=0.0, replicas=5), CFG, 20.0)
    assert d.replicas == 6  # ceil(500 / 75) = 7, capped at max_replicas


def test_one_waiting_request_in_one_push_does_not_scale_out() -> None:
    """The flapping: one request waited for one 2 s push, at 30% KV use. Serve's
    time-weighted mean over the 15 s look-back shows it as 2 / 15 waiting for the
    whole window (longer than scale_out_after_s); a 0 threshold scaled 1 -> 2 on it
    and back in a minute later."""
    serve_mean = 1.0 * CFG.metrics_interval_s / CFG.look_back_period_s
    ticks = [
        (t, fleet([30], waiting=[serve_mean if 2.0 <= t < 17.0 else 0.0]))
        for t in (float(i) for i in range(0, 40))
    ]
    assert run(ticks) == [1] * 40
    # Nor if the policy saw the raw push (a look-back as short as the push interval).
    raw = [(t, fleet([30], waiting=[1.0 if t < 2.0 else 0.0])) for t in (0.0, 1.0, 10.0, 11.0)]
    assert run(raw) == [1, 1, 1, 1]
    # With 2 replicas it is no reason to keep both either: it scales in as if none waited.
    two = [(t, fleet([15, 15], waiting=[serve_mean, 0.0])) for t in (0.0, 29.0, 30.0)]
    assert run(two) == [2, 2, 1]


def test_a_sustained_queue_scales_out_at_low_utilisation() -> None:
    queued = fleet([30], waiting=[5])  # 5 > 4 waiting per replica, at 30% KV use
    assert run([(0.0, queued), (5.0, queued), (9.9, queued), (10.0, queued)]) == [1, 1, 1, 2]
    d = decide(queued, AutoscalerState(high_since=0.0, replicas=1), CFG, 10.0)
    assert (d.replicas, d.reason) == (2, "scale out")
    # The fleet's mean counts: 10 + 0 over 2 replicas is 5 per replica; 8 + 0 is 4.
    assert run([(0.0, fleet([30, 20], waiting=[10, 0])), (10.0, fleet([30, 20], [10, 0]))]) == [
        2,
        3,
    ]
    assert run([(0.0, fleet([30, 20], waiting=[8, 0])), (10.0, fleet([30, 20], [8, 0]))]) == [
        2,
        2,
    ]
    tolerant = AutoscalingPolicyConfig(max_waiting_per_replica=6.0, scale_out_after_s=0.0)
    assert run([(0.0, fleet([30, 20], [10, 0]))], tolerant) == [2]


def test_the_queue_must_stay_long_for_the_whole_hold() -> None:
    long_, short = fleet([30], waiting=[6]), fleet([30], waiting=[3])
    ticks = [(0.0, long_), (5.0, short), (6.0, long_), (15.0, long_), (16.0, long_)]
    assert run(ticks) == [1, 1, 1, 1, 2]  # the dip at 5 s restarted the 10 s hold


def test_scale_in_waits_for_the_queue_to_fall_below_the_lower_level() -> None:
    # 10% KV use, below the band, but 2 waiting per replica: between the scale-in level
    # (1) and the scale-out level (4), so neither: the fleet holds.
    mid_queue = fleet([10, 10], waiting=[4, 0])
    d = decide(mid_queue, AutoscalerState(low_since=0.0, replicas=2), CFG, 100.0)
    assert (d.replicas, d.reason, d.state) == (2, "in band", AutoscalerState(replicas=2))
    assert run([(0.0, mid_queue), (100.0, mid_queue)]) == [2, 2]
    short_queue = fleet([10, 10], waiting=[2, 0])  # 1 per replica: at the lower level
    assert run([(0.0, short_queue), (29.0, short_queue), (30.0, short_queue)]) == [2, 2, 1]
    strict = AutoscalingPolicyConfig(
        max_waiting_per_replica=0.0, scale_in_waiting_per_replica=0.0, scale_in_after_s=0.0
    )
    assert run([(0.0, fleet([10, 10], waiting=[0.5, 0]))], strict) == [2]  # waiting: high
    assert run([(0.0, fleet([10, 10]))], strict) == [1]


def test_scales_in_below_the_band_one_step_at_a_time() -> None:
    low = fleet([10, 10, 10, 10])  # u = 0.10 < 0.40
    assert run([(0.0, low), (29.0, low), (30.0, low)]) == [4, 4, 3]
    # The fleet changed (3 running): the timer restarts on it.
    low3 = fleet([13, 13, 14])
    state = AutoscalerState(low_since=0.0, replicas=4)
    d = decide(low3, state, CFG, 31.0)
    assert (d.replicas, d.state) == (3, AutoscalerState(low_since=31.0, replicas=3))
    assert decide(low3, d.state, CFG, 61.0).replicas == 2


def test_a_scale_in_is_announced_scale_in_notice_s_before_it_is_due() -> None:
    # scale_in_after_s 30, notice 20 (default) but at most half the hold: from 15 s on.
    low = fleet([10, 10, 10, 10])
    state, seen = AutoscalerState(), []
    for now in (0.0, 14.0, 15.0, 29.0, 30.0):
        d = decide(low, state, CFG, now)
        state = d.state
        seen.append((d.replicas, d.leaving, d.reason))
    assert seen == [
        (4, 0, "low, holding"),
        (4, 0, "low, holding"),
        (4, 1, "low, scale-in announced"),
        (4, 1, "low, scale-in announced"),
        (3, 0, "scale in"),  # due: the notice has become the target
    ]
    # Low use breaks: the notice is withdrawn with the timer.
    band = fleet([50, 50, 50, 50])
    assert decide(band, AutoscalerState(low_since=0.0, replicas=4), CFG, 20.0).leaving == 0
    # Nothing would go (the running blocks need every replica): no notice.
    need = AutoscalingPolicyConfig(min_replicas=4, max_replicas=6, scale_in_after_s=30.0)
    assert decide(low, AutoscalerState(low_since=0.0, replicas=4), need, 20.0).leaving == 0
    # A shorter notice: its own length; notice 0: none.
    short = AutoscalingPolicyConfig(scale_in_after_s=30.0, scale_in_notice_s=5.0, max_replicas=6)
    assert decide(low, AutoscalerState(low_since=0.0, replicas=4), short, 24.0).leaving == 0
    assert decide(low, AutoscalerState(low_since=0.0, replicas=4), short, 25.0).leaving == 1
    quiet = AutoscalingPolicyConfig(scale_in_after_s=30.0, scale_in_notice_s=0.0, max_replicas=6)
    assert decide(low, AutoscalerState(low_since=0.0, replicas=4), quiet, 29.0).leaving == 0


def test_scale_in_keeps_room_for_the_hot_cache() -> None:
    """Low use (0.10 of 4 x 100 blocks) but 150 cached blocks reused in the last minute:
    a scale-in leaves room for used + hot at the target, ceil((40 + 150) / 75) = 3; with
    300 hot, none (ceil(340 / 75) = 5 > 4); without the setting, one step as before."""

    def hot(blocks: float) -> FleetSample:
        reps = {f"r{i}": ReplicaKV(10, 100, 1.0, 0.0, hot_blocks=blocks / 4) for i in range(4)}
        return FleetSample(4, 4, reps)

    held = AutoscalerState(low_since=0.0, replicas=4)
    assert decide(hot(150), held, CFG, 30.0).replicas == 3
    assert decide(hot(40), held, CFG, 15.0).leaving == 1
    none = decide(hot(300), held, CFG, 30.0)
    assert (none.replicas, none.reason, decide(hot(300), held, CFG, 15.0).leaving) == (
        4,
        "low, scale-in held at 5",
        0,
    )
    off = dataclasses.replace(CFG, scale_in_keeps_hot_cache=False)
    assert decide(hot(300), held, off, 30.0).replicas == 3
    # Held past the hold, then let go: announced afresh, the scale-in 15 s (the notice)
    # after the last tick that held it.
    state, seen = none.state, []
    for now in (31.0, 32.0, 44.0, 45.0):
        d = decide(hot(40), state, CFG, now)
        state = d.state
        seen.append((d.replicas, d.leaving))
    assert none.state.held_at == 30.0
    assert seen == [(4, 1), (4, 1), (4, 1), (3, 0)]


def test_no_scale_in_inside_the_band_or_with_waiting_requests() -> None:
    band = fleet([50, 50])  # 0.50: between 0.40 and 0.75
    assert run([(0.0, band), (100.0, band)]) == [2, 2]
    low_but_queued = fleet([10, 10], waiting=[0, 9])  # 4.5 per replica, above 4
    d = decide(low_but_queued, AutoscalerState(low_since=0.0, replicas=2), CFG, 100.0)
    assert d.reason.startswith("high")  # waiting wins: a scale-out is being timed


def test_scale_in_never_lands_above_target_or_below_running_blocks() -> None:
    # u = 0.39 over 4 replicas: one step in gives 3 replicas at 0.52, within the band.
    d = decide(fleet([39, 39, 39, 39]), AutoscalerState(low_since=0.0, replicas=4), CFG, 30.0)
    assert d.replicas == 3
    # A big step allowed, but not below ceil(used / (0.75 * 100)) = ceil(156 / 75) = 3.
    big = AutoscalingPolicyConfig(max_scale_in_step=10, scale_in_after_s=0.0, max_replicas=8)
    assert decide(fleet([39, 39, 39, 39]), AutoscalerState(), big, 0.0).replicas == 3


def test_never_fewer_than_the_running_requests_blocks_need() -> None:
    # min_replicas 1, in band, but the target dropped under what running requests hold
    # (e.g. a manual target): used 250 blocks of 100 per replica need 3 replicas.
    d = decide(fleet([60, 60, 65, 65], target=2), AutoscalerState(), CFG, 0.0)
    assert d.replicas == 3
    assert "floor" in d.reason


def test_min_and_max_replicas_bound_every_decision() -> None:
    cfg = AutoscalingPolicyConfig(
        min_replicas=2, max_replicas=3, scale_in_after_s=0.0, scale_out_after_s=0.0
    )
    assert decide(fleet([0, 0, 0]), AutoscalerState(), cfg, 0.0).replicas == 2
    assert decide(fleet([100, 100, 100]), AutoscalerState(), cfg, 0.0).replicas == 3
    assert decide(fleet([5]), AutoscalerState(), cfg, 0.0).replicas == 2  # below min: raised
    # No metrics yet: hold the target, within bounds.
    assert decide(FleetSample(1, 1, {}), AutoscalerState(), cfg, 0.0).replicas == 2


def test_holds_replicas_that_are_still_starting() -> None:
    # 2 running, target 3 (one starting), in band: keep 3, do not cancel the new one.
    assert decide(fleet([50, 50], target=3), AutoscalerState(), CFG, 0.0).replicas == 3
    # Repeating a scale-out decision while the new replica starts does not compound.
    state = AutoscalerState(high_since=0.0, replicas=2)
    assert decide(fleet([90, 90], target=3), state, CFG, 20.0).replicas == 3


def test_config_validates() -> None:
    with pytest.raises(ValueError):
        AutoscalingPolicyConfig(target_kv_utilization=0.0)
    with pytest.raises(ValueError):
        AutoscalingPolicyConfig(scale_in_kv_utilization=0.8)  # above the target
    with pytest.raises(ValueError):
        AutoscalingPolicyConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        AutoscalingPolicyConfig(initial_replicas=9)
    with pytest.raises(ValueError):  # the scale-in level above the scale-out level
        AutoscalingPolicyConfig(max_waiting_per_replica=2.0, scale_in_waiting_per_replica=3.0)
    assert (CFG.max_waiting_per_replica, CFG.scale_in_waiting_per_replica) == (4.0, 1.0)
    assert AutoscalingPolicyConfig(**CFG.policy_kwargs()) == CFG


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


@dataclass
class FakeContext:
    """The AutoscalingContext fields the adapter reads (Serve 2.60 names)."""

    current_num_replicas: int
    target_num_replicas: int
    aggregated_metrics: dict[str, dict[Any, float]]
    policy_state: dict[str, Any] = field(default_factory=dict)
    current_time: float | None = None
    app_name: str = "pagefleet"
    deployment_name: str = "EngineReplica"
    raw_metrics: dict[str, dict[Any, list[Any]]] | None = None


def ctx(used: list[float], now: float | None, state: dict[str, Any] | None = None) -> FakeContext:
    ids = [FakeReplicaID(f"r{i}") for i in range(len(used))]
    metrics = {
        METRIC_KV_USED_BLOCKS: dict(zip(ids, used, strict=True)),
        METRIC_KV_TOTAL_BLOCKS: dict.fromkeys(ids, 100.0),
        METRIC_RUNNING: dict.fromkeys(ids, 2.0),
        METRIC_WAITING: dict.fromkeys(ids, 0.0),
    }
    return FakeContext(len(used), len(used), metrics, state or {}, now)


def test_serve_adapter_threads_state_through_policy_state() -> None:
    published: list[tuple[bytes, AutoscalerStatus]] = []
    policy = KVCacheAutoscalingPolicy(
        publish=lambda k, s: published.append((k, s)), **CFG.policy_kwargs()
    )
    n, state = policy(ctx([90, 80], now=0.0, state={"serve-internal": 1}))
    assert n == 2
    assert state == {
        "pagefleet.high_since": 0.0,
        "pagefleet.low_since": None,
        "pagefleet.replicas": 2,
        "pagefleet.held_at": None,
    }
    n, state = policy(ctx([90, 80], now=10.0, state=state))
    assert n == 3
    # What the ingress exports: running and target replicas, the utilisation acted on
    # (KV, and compute: these replicas report none).
    key = b"pagefleet/autoscaler/pagefleet/EngineReplica"
    assert published == [
        (key, AutoscalerStatus(2, 2, 0.85, 0.0, compute_utilization=0.0)),
        (key, AutoscalerStatus(2, 3, 0.85, 10.0, compute_utilization=0.0)),
    ]
    assert AutoscalerStatus.from_json(published[1][1].to_json()) == published[1][1]


def test_a_failing_publish_never_stops_the_policy() -> None:
    def broken(key: bytes, status: AutoscalerStatus) -> None:
        raise ConnectionError("GCS unreachable")

    policy = KVCacheAutoscalingPolicy(publish=broken, **CFG.policy_kwargs())
    assert policy(ctx([90, 80], now=0.0))[0] == 2


def test_serve_adapter_uses_its_injected_clock_without_current_time() -> None:
    clock = iter([100.0, 110.0])
    policy = KVCacheAutoscalingPolicy(clock=lambda: next(clock), **CFG.policy_kwargs())
    _, state = policy(ctx([90, 80], now=None))
    n, _ = policy(ctx([90, 80], now=None, state=state))
    assert n == 3


def test_replica_metrics_from_engine_stats() -> None:
    stats = EngineStats(
        num_total_blocks=100,
        num_free_blocks=30,
        block_size=16,
        num_running=4,
        num_waiting=2,
        num_preemptions=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
        num_hot_cached_blocks=12,
    )
    assert autoscaling_stats_from_engine(stats, 32) == {
        METRIC_KV_USED_BLOCKS: 70.0,
        METRIC_KV_TOTAL_BLOCKS: 100.0,
        METRIC_RUNNING: 4.0,
        METRIC_WAITING: 2.0,
        METRIC_MAX_NUM_SEQS: 32.0,
        METRIC_KV_HOT_BLOCKS: 12.0,
        METRIC_COMPUTE: 0.0,
    }
    assert autoscaling_stats_from_engine(stats, 32, 0.4)[METRIC_COMPUTE] == 0.4


def test_the_compute_meter_is_the_busy_counters_rate_between_readings() -> None:
    meter = ComputeMeter()
    assert meter.read(5.0, 100.0) == 0.0  # no interval yet
    assert meter.read(5.5, 102.0) == 0.25  # 0.5 busy-budget seconds over 2 s
    assert meter.read(7.5, 104.0) == 1.0
    assert meter.read(7.5, 104.0) == 0.0  # no time passed
    assert meter.read(9.0, 105.0) == 1.0  # clipped: a step counted at its end overlaps
    assert meter.read(0.0, 107.0) == 0.0  # a restarted engine's counter: clipped at 0


def computing(compute: list[float], used: float = 10.0) -> FleetSample:
    """Replicas at low KV use, each at its compute use."""
    reps = {f"r{i}": ReplicaKV(used, 100.0, 1.0, 0.0, compute=c) for i, c in enumerate(compute)}
    return FleetSample(len(compute), len(compute), reps)


def test_compute_use_past_its_target_scales_out_to_the_replicas_that_carry_it() -> None:
    """Long prompts queue for compute at low KV use and no waiting: the mean compute use
    past target_compute_utilization (0.25) for the hold scales out, at once to
    ceil(sum / 0.25) replicas, not one replica per hold."""
    assert CFG.target_compute_utilization == 0.25
    ticks = [(t, computing([0.3, 0.35])) for t in (0.0, 5.0, 10.0)]
    assert run(ticks) == [2, 2, 3]  # ceil(0.65 / 0.25) = 3
    d = decide(computing([0.8, 0.7]), AutoscalerState(high_since=0.0, replicas=2), CFG, 10.0)
    assert (d.replicas, d.reason) == (6, "scale out")  # ceil(1.5 / 0.25)
    # At or under the target on the mean: no scale-out, one busy replica or not.
    assert run([(t, computing([0.4, 0.1])) for t in (0.0, 10.0, 20.0)]) == [2, 2, 2]
    # 1 turns it off: the policy as it was.
    off = dataclasses.replace(CFG, target_compute_utilization=1.0)
    assert run([(t, computing([0.9, 0.9])) for t in (0.0, 10.0)], off) == [2, 2]


def test_scale_in_never_lands_above_the_compute_target() -> None:
    """Four replicas at 10% KV use would go to three, but their compute (4 x 0.2) needs
    ceil(0.8 / 0.25) = 4 at the target: held. At 0.15 each (ceil(0.6 / 0.25) = 3) one goes."""
    busy = [(t, computing([0.2] * 4)) for t in (0.0, 30.0, 40.0)]
    assert run(busy) == [4, 4, 4]
    d = decide(computing([0.2] * 4), AutoscalerState(low_since=0.0, replicas=4), CFG, 40.0)
    assert d.reason == "low, scale-in held at 4"
    quieter = [(t, computing([0.15] * 4)) for t in (0.0, 30.0)]
    assert run(quieter) == [4, 3]


def test_the_adapter_reads_compute_use_as_serves_mean() -> None:
    ids = [FakeReplicaID("a"), FakeReplicaID("b")]
    metrics = {
        METRIC_KV_USED_BLOCKS: dict.fromkeys(ids, 10.0),
        METRIC_KV_TOTAL_BLOCKS: dict.fromkeys(ids, 100.0),
        METRIC_COMPUTE: {ids[0]: 0.5, ids[1]: 0.25},
    }
    sample = sample_from_context(FakeContext(2, 2, metrics, {}, 0.0))
    assert [r.compute for r in sample.replicas.values()] == [0.5, 0.25]
    # What the status (and `pagefleet:autoscaler_compute_utilization`) carries: the mean.
    published: list[AutoscalerStatus] = []
    policy = KVCacheAutoscalingPolicy(
        publish=lambda k, s: published.append(s), **CFG.policy_kwargs()
    )
    policy(FakeContext(2, 2, metrics, {}, 0.0))
    assert published[0].compute_utilization == 0.375
    assert AutoscalerStatus.from_json(published[0].to_json()) == published[0]
    # A status published before the field existed still reads.
    old = b'{"replicas": 2, "target_replicas": 2, "kv_utilization": 0.1, "time": 0.0}'
    assert AutoscalerStatus.from_json(old).compute_utilization is None


# A saturated replica: lock-step waves and full batches, through the adapter, with Serve's
# look-back window (raw points and their mean) simulated once a second.

# configs/local.yaml's autoscaling, with a scale-out hold of 5 s (the file's is 2 s).
LOCAL = AutoscalingPolicyConfig(
    min_replicas=1,
    max_replicas=2,
    target_kv_utilization=0.75,
    scale_in_kv_utilization=0.4,
    scale_out_after_s=5.0,
    scale_in_after_s=60.0,
    look_back_period_s=5.0,
    metrics_interval_s=1.0,
)


@dataclass(frozen=True)
class Point:
    """Serve's `TimeStampedValue`, as the adapter reads it."""

    timestamp: float
    value: float


def serve_loop(
    load: Any,
    seconds: int,
    max_num_seqs: float = 32.0,
    raw: bool = True,
    startup_s: int = 3,
    config: AutoscalingPolicyConfig = LOCAL,
) -> list[tuple[int, int]]:
    """Serve's control loop once a second. `load(t, replicas)` gives each replica's KV
    utilisation and running requests at second t (the router balances them); each replica
    records one point a second, Serve keeps look_back_period_s of them (`raw_metrics`) and
    their mean (`aggregated_metrics`). A replica asked for serves `startup_s` later; one let
    go leaves at once. Returns the target's changes: (second, target), from (0, 1)."""
    policy = KVCacheAutoscalingPolicy(publish=None, **config.policy_kwargs())
    total, state, target, replicas = 512.0, {}, 1, 1
    history: list[tuple[int, float, float]] = []
    asked_at, changes = 0, [(0, 1)]
    for t in range(seconds):
        if target > replicas and t - asked_at >= startup_s:
            replicas = target
        kv, busy = load(t, replicas)
        history.append((t, kv * total, busy))
        window = [h for h in history if h[0] > t - config.look_back_period_s]
        ids = [FakeReplicaID(f"r{i}") for i in range(replicas)]
        used = [Point(ts, u) for ts, u, _ in window]
        running = [Point(ts, n) for ts, _, n in window]
        metrics = {
            METRIC_KV_USED_BLOCKS: dict.fromkeys(ids, sum(p.value for p in used) / len(used)),
            METRIC_KV_TOTAL_BLOCKS: dict.fromkeys(ids, total),
            METRIC_RUNNING: dict.fromkeys(ids, sum(p.value for p in running) / len(running)),
            METRIC_WAITING: dict.fromkeys(ids, 0.0),
        }
        if raw:  # before: neither the points nor the batch limit reached the policy
            metrics[METRIC_MAX_NUM_SEQS] = dict.fromkeys(ids, max_num_seqs)
        context = FakeContext(replicas, target, metrics, state, float(t))
        context.raw_metrics = (
            {
                METRIC_KV_USED_BLOCKS: dict.fromkeys(ids, used),
                METRIC_RUNNING: dict.fromkeys(ids, running),
            }
            if raw
            else None
        )
        wanted, state = policy(context)
        if wanted != target:
            changes.append((t, wanted))
            asked_at = t
            if wanted < replicas:
                replicas = wanted
        target = wanted
    return changes


def waves(peak: float, low_running: float, high_running: float, burst_s: int = 120) -> Any:
    """Lock-step waves of one replica's worth of users for `burst_s`, then none: KV use
    0 between waves (they all finished), then up from peak / 2 to `peak` over 9 s as they
    write their tokens; running between the two levels. Split evenly over the replicas."""

    def load(t: int, replicas: int) -> tuple[float, float]:
        if t >= burst_s:
            return 0.0, 0.0
        phase = t % 10
        kv = 0.0 if phase == 0 else peak / 2 + peak / 18 * phase
        running = low_running + (high_running - low_running) * (t % 5) / 4
        return kv / replicas, running / replicas

    return load


def test_lock_step_waves_on_a_full_batch_scale_out_within_the_delay_and_back_in() -> None:
    """The issue's run: KV 0.9 -> 0 -> 0.9 (Serve's mean 0.63, under the 0.75 target), 28-32
    running of max_num_seqs 32. The full batch is high from the first second: 1 -> 2 at
    scale_out_after_s (5 s). Two replicas hold through the burst (each runs 14-16, its
    KV peaks at 0.45); after it, once the window holds only idle points (4 s), the
    scale-in hold (60 s) runs out: back to 1 at 120 + 4 + 60 s."""
    assert serve_loop(waves(0.9, 28, 32), 200) == [(0, 1), (5, 2), (184, 1)]
    # Before: Serve's mean, no batch limit. The target never left 1.
    assert serve_loop(waves(0.9, 28, 32), 200, raw=False) == [(0, 1)]


def test_lock_step_kv_waves_alone_scale_out_on_their_peaks() -> None:
    """The same waves, 28-32 running of max_num_seqs 64 (no full batch): the KV read as the
    window's 0.9 quantile (its peak, at 5 points) is above the target from second 7 (0.8
    entered the window) until the wave's top has left it; 5 s of that is a scale-out."""
    assert serve_loop(waves(0.9, 28, 32), 200, max_num_seqs=64) == [(0, 1), (12, 2), (184, 1)]


def test_a_full_batch_at_low_kv_use_scales_out() -> None:
    """Short requests: 30 of 32 running at a steady 30 % KV use."""
    assert serve_loop(lambda t, n: (0.3 / n, 30 / n), 60) == [(0, 1), (5, 2)]
    # 26 of 32 is under the saturation level (0.85 * 32 = 27.2): in band.
    assert serve_loop(lambda t, n: (0.3 / n, 26 / n), 60) == [(0, 1)]
    # A measured saturation point replaces max_num_seqs: 26 running, saturated at 24.
    measured = AutoscalingPolicyConfig(**{**LOCAL.policy_kwargs(), "saturation_running": 24})
    assert serve_loop(lambda t, n: (0.3 / n, 26 / n), 60, config=measured) == [(0, 1), (5, 2)]


def test_the_same_waves_at_a_genuinely_low_load_do_not_scale_out() -> None:
    """4-8 users in lock-step: KV peaks at 0.3, the batch a quarter full."""
    assert serve_loop(waves(0.3, 4, 8), 200) == [(0, 1)]


def test_scale_in_keeps_enough_replicas_for_the_running_batch() -> None:
    """Low KV use, but 2 x 14 running would put 28 on one replica, over 0.85 * 32: hold 2
    (while the low spell is timed). 2 x 12 = 24 fits on one: scale in."""
    state = AutoscalerState(low_since=0.0, replicas=2)

    def two(running: float) -> FleetSample:
        rep = ReplicaKV(10, 100, running, 0.0, 32.0)
        return FleetSample(2, 2, {"r0": rep, "r1": rep})

    d = decide(two(14), state, LOCAL, 60.0)
    assert (d.replicas, d.reason) == (2, "low, scale-in held at 2")
    assert decide(two(12), state, LOCAL, 60.0).replicas == 1
    # Idle, with min_replicas 0: nothing running holds no replica.
    idle = ReplicaKV(0, 100, 0.0, 0.0, 32.0)
    to_zero = AutoscalingPolicyConfig(min_replicas=0, scale_in_after_s=0.0)
    assert decide(FleetSample(1, 1, {"r0": idle}), AutoscalerState(), to_zero, 0.0).replicas == 0


def test_the_window_quantile_reads_raw_points() -> None:
    ids = [FakeReplicaID("r0")]
    points = [Point(float(t), u) for t, u in enumerate([0, 50, 60, 70, 90])]
    c = ctx([54.0], now=0.0)
    c.aggregated_metrics[METRIC_KV_USED_BLOCKS] = dict.fromkeys(ids, 54.0)
    c.raw_metrics = {METRIC_KV_USED_BLOCKS: dict.fromkeys(ids, points)}
    assert sample_from_context(c).replicas["r0"].used_blocks == 54.0  # Serve's mean
    assert sample_from_context(c, 0.9).replicas["r0"].used_blocks == 90.0  # 5 points: the top
    assert sample_from_context(c, 0.5).replicas["r0"].used_blocks == 60.0
    assert window_quantile([float(x) for x in range(10)], 0.9) == 8.0
    # No raw series for running: Serve's mean.
    assert sample_from_context(c, 0.9).replicas["r0"].running == 2.0
    with pytest.raises(ValueError):
        AutoscalingPolicyConfig(kv_utilization_quantile=0.0)
    with pytest.raises(ValueError):
        AutoscalingPolicyConfig(saturation_running=0)


def test_the_ingress_exports_the_compute_use_the_policy_acted_on() -> None:
    """`fleet_families`, what the ingress adds to /metrics from the policy's status."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.cluster.metrics import exposition, fleet_families

    def scrape(families: list[Any]) -> dict[str, float]:
        text = exposition([families]).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    assert scrape(fleet_families("tiny", 3, 4, 0.5, 0.375)) == {
        "pagefleet:replicas": 3.0,
        "pagefleet:target_replicas": 4.0,
        "pagefleet:autoscaler_kv_utilization": 0.5,
        "pagefleet:autoscaler_compute_utilization": 0.375,
    }
    assert "pagefleet:autoscaler_compute_utilization" not in scrape(
        fleet_families("tiny", 3, 4, 0.5)
    )
