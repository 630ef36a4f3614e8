"""`pagefleet-lab simulate`: the fleet simulator, its workloads, step models and report."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from pagefleet.cluster.autoscaling import AutoscalingPolicyConfig
from pagefleet_lab.cli import add_lab_parser, run_lab
from pagefleet_lab.sim.fleet import (
    Fleet,
    ReplicaShape,
    RunResult,
    SimAutoscale,
)
from pagefleet_lab.sim.policies import POLICIES, policy_factory
from pagefleet_lab.sim.step_model import (
    H200_LLAMA31_8B,
    LinearStepModel,
    ScaledStepModel,
    StepShape,
    decode_run_ends,
    fit_linear,
    load_cpu_fit,
)
from pagefleet_lab.sim.workloads import (
    Prompts,
    SimRequest,
    multi_tenant,
    read_trace,
    sinusoidal,
    skewed,
)

SMALL = ReplicaShape(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
STEP = LinearStepModel(0.005, 2e-5, 1e-4, 1e-7)


def small_workload(seed: int = 0) -> list[SimRequest]:
    return list(multi_tenant(30.0, 3.0, 6, 96, 24, 8, seed))


def run_small(policy: str, seed: int = 0) -> tuple[Fleet, object]:
    fleet = Fleet(3, SMALL, STEP, stats_period_s=0.5)
    result = fleet.run(small_workload(seed), lambda f: POLICIES[policy](f, seed), 3.0, 0.5)
    return fleet, result


def test_a_seed_gives_exactly_the_same_run() -> None:
    _, a = run_small("most_free_blocks")
    _, b = run_small("most_free_blocks")
    keys = ("arrival_s", "ttft_s", "itl_s", "end_s", "output_tokens", "preemptions")
    assert [getattr(a, k) for k in keys] == [getattr(b, k) for k in keys]
    assert (a.prefix_hits, a.prefix_queries, a.steps) == (b.prefix_hits, b.prefix_queries, b.steps)
    _, c = run_small("most_free_blocks", seed=1)
    assert c.ttft_s != a.ttft_s


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_serves_everything_and_every_pool_balances(policy: str) -> None:
    fleet, result = run_small(policy)
    assert result.unfinished == 0
    assert all(result.finished)
    expected = [r for r in small_workload() if r.arrival_s >= 0.5]
    assert sorted(result.output_tokens) == sorted(r.output_tokens for r in expected)
    fleet.check_accounting()
    for r in fleet.replicas:
        bm = r.engine.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks
        assert r.unfinished == 0 and r.active_tokens == 0
    assert result.prefix_hits > 0  # 6 tenants, 96-token system prompts: shared blocks hit


def test_two_replicas_four_requests_exact_ttfts() -> None:
    """Round robin: r0 takes requests 0 and 2, r1 requests 1 and 3 (10-token prompts, 3
    tokens out). Step time 0.01 + 0.001 / prefill token + 0.002 / decoding sequence."""
    shape = ReplicaShape(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    model = LinearStepModel(0.01, 0.001, 0.002, 0.0)
    reqs = [
        SimRequest(0, 0.0, (), 10, 100, 3),
        SimRequest(1, 0.0, (), 10, 101, 3),
        SimRequest(2, 0.025, (), 10, 102, 3),
        SimRequest(3, 0.5, (), 10, 103, 3),
    ]
    fleet = Fleet(2, shape, model, stats_period_s=1.0)
    result = fleet.run(reqs, lambda f: POLICIES["round_robin"](f, 0), 1.0)
    by_arrival = sorted(zip(result.arrival_s, result.ttft_s, result.end_s, strict=True))
    # r0: request 0 prefills 0 -> 0.02 (its first token), decodes 0.02 -> 0.032; request 2
    # (arrived 0.025, mid-step) joins the next step: its prefill and request 0's last
    # decode, 0.032 -> 0.054 (request 0 done, request 2's first token), then request 2
    # decodes alone: 0.066, 0.078 (done). r1: requests 1 and 3 alone: 0.02, 0.032, 0.044.
    assert [a for a, _, _ in by_arrival] == [0.0, 0.0, 0.025, 0.5]
    assert [t for _, t, _ in by_arrival] == pytest.approx([0.02, 0.02, 0.029, 0.02])
    assert sorted(result.end_s) == pytest.approx([0.044, 0.054, 0.078, 0.544])
    assert result.preemptions == 0
    fleet.check_accounting()


def test_the_fit_recovers_known_coefficients() -> None:
    rng = random.Random(0)
    truth = LinearStepModel(0.012, 3e-5, 4e-4, 2e-7)
    shapes = [
        StepShape(rng.randrange(0, 4096), rng.randrange(0, 128), rng.randrange(0, 100_000), 0)
        for _ in range(60)
    ]
    fit = fit_linear(shapes, [truth.seconds(s) for s in shapes])
    for name in "abcd":
        assert getattr(fit.model, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fit.rmse_s < 1e-9 and fit.r2 == pytest.approx(1.0)
    noisy = fit_linear(shapes, [truth.seconds(s) * rng.uniform(0.98, 1.02) for s in shapes])
    assert noisy.model.b == pytest.approx(truth.b, rel=0.1)
    assert 0 < noisy.median_abs_rel < 0.02


def test_the_committed_cpu_fit_loads() -> None:
    fit = load_cpu_fit()
    assert fit.points > 10 and fit.model.a > 0


def test_the_roofline_is_memory_bound_decoding_and_compute_bound_prefilling() -> None:
    m = H200_LLAMA31_8B
    assert m.kv_bytes_per_token == 131072
    decode = m.seconds(StepShape(0, 1, 1000, 1000))
    assert decode == pytest.approx(0.002 + (16.06e9 + 1000 * 131072) / 4.8e12)
    prefill = m.seconds(StepShape(8192, 0, 8192, 8192 * 8193 // 2))
    assert prefill == pytest.approx(
        0.002 + (16.06e9 * 8192 + 4 * 32 * 32 * 128 * 8192 * 8193 // 2) / 990e12
    )
    assert m.seconds(StepShape(0, 0, 0, 0)) == 0.0
    assert 700_000 < m.kv_capacity_tokens < 900_000


class _SecondsOnly:
    """A step model with `seconds` alone: `decode_run_ends` loops over it."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def seconds(self, shape: StepShape) -> float:
        return self.inner.seconds(shape)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(
    "model",
    [
        H200_LLAMA31_8B,
        LinearStepModel(0.012, 3e-5, 4e-4, -2e-9),
        ScaledStepModel(H200_LLAMA31_8B, 1.324),
        ScaledStepModel(_SecondsOnly(LinearStepModel(0.01, 1e-5, 2e-4, 3e-7)), 1.3),
    ],
)
def test_a_decode_runs_step_ends_are_the_step_by_step_sums_bit_for_bit(model: object) -> None:
    rng = random.Random(3)
    for _ in range(100):
        start, n = rng.random() * 3600, rng.randrange(1, 300)
        kv0, k = rng.randrange(10**6), rng.randrange(1, 400)
        ends = decode_run_ends(model, start, n, kv0, k)  # type: ignore[arg-type]
        t, loop = start, []
        for i in range(1, k + 1):
            t += model.seconds(StepShape(0, n, kv0 + n * i, kv0 + n * i))  # type: ignore[attr-defined]
            loop.append(t)
        assert ends == loop


def test_multi_tenant_shape() -> None:
    reqs = list(multi_tenant(50.0, 20.0, 7, 300, 40, 12, seed=3))
    assert 900 < len(reqs) < 1100  # Poisson: 1000 expected
    assert all(a.arrival_s < b.arrival_s for a, b in itertools.pairwise(reqs))
    assert {r.prompt_tokens for r in reqs} == {340} and {r.output_tokens for r in reqs} == {12}
    assert {r.pieces[0][0] for r in reqs} == set(range(7))
    prompts = Prompts()
    a, b, *_ = (r for r in reqs if r.pieces[0][0] == reqs[0].pieces[0][0])
    ta, tb = prompts.tokens(a), prompts.tokens(b)
    assert len(ta) == 340 and ta[:300] == tb[:300] and ta[300:] != tb[300:]
    assert list(multi_tenant(50.0, 20.0, 7, 300, 40, 12, seed=3)) == reqs


def test_skewed_and_sinusoidal_shapes() -> None:
    reqs = list(skewed(100.0, 20.0, 0.2, (1000, 2000), (100, 200), (10, 50), (5, 10), seed=1))
    long = [r for r in reqs if r.kind == "long"]
    assert 0.15 < len(long) / len(reqs) < 0.25
    assert all(1000 <= r.prompt_tokens <= 2000 and 100 <= r.output_tokens <= 200 for r in long)
    short = [r for r in reqs if r.kind == "short"]
    assert all(10 <= r.prompt_tokens <= 50 and 5 <= r.output_tokens <= 10 for r in short)
    assert all(not r.pieces for r in reqs)  # no shared prefix
    # 100 QPS thinned to 10..100 over 10 s: the troughs (t ~ 0, 10) carry ~1/10 of the peak.
    wave = list(sinusoidal(iter(reqs), 10.0, 100.0, 10.0, seed=1))
    trough = sum(1 for r in wave if r.arrival_s % 10 < 1 or r.arrival_s % 10 >= 9)
    peak = sum(1 for r in wave if 4 <= r.arrival_s % 10 < 6)
    assert 0.5 * len(reqs) * 0.55 < len(wave) < len(reqs) * 0.55 * 1.5  # mean rate 55
    assert peak > 5 * trough


def test_the_trace_reader(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 600, "output_length": 0, "hash_ids": [7, 11]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = list(read_trace(path))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0]
    assert [r.prompt_tokens for r in reqs] == [1200, 600, 1100]
    assert [r.output_tokens for r in reqs] == [10, 1, 5]  # at least one token out
    assert reqs[0].pieces == ((7, 512), (8, 512), (9, 176))
    assert reqs[1].pieces == ((7, 512), (11, 88))
    assert reqs[2].pieces == ((7, 512),) and reqs[2].tail_tokens == 588  # past its ids
    prompts = Prompts()
    t0, t1 = prompts.tokens(reqs[0]), prompts.tokens(reqs[1])
    assert t0[:512] == t1[:512] and t0[512:600] != t1[512:600]
    assert [r.arrival_s for r in read_trace(path, time_scale=2.0, limit=2)] == [0.0, 0.25]


def test_the_command_writes_the_report(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    out = tmp_path / "simulate"
    args = parser.parse_args(
        [
            "simulate",
            "--replicas",
            "2",
            "--qps-at",
            "",
            "--qps",
            "4",
            "--duration",
            "2",
            "--warmup",
            "0.5",
            "--kv-blocks",
            "512",
            "--system-tokens",
            "256",
            "--query-tokens",
            "32",
            "--output-tokens",
            "8",
            "--policies",
            "random,load_only,approx_prefix,most_free_blocks,power_of_two",
            "--out",
            str(out),
        ]
    )
    assert run_lab(args) == 0
    text = out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").exists()
    assert "p90 TTFT (s), multi_tenant, 2 replicas" in text
    assert "power_of_two / most_free_blocks" in text
    rows = [line for line in text.splitlines() if line.startswith("| multi_tenant | 2 |")]
    assert len(rows) == 5


def assert_same_run(a: RunResult, b: RunResult, *more: str) -> None:
    """Every request's timings and tokens, and the fleet's counters, exactly equal
    (`repr`: NaN ITLs compare equal); `more`: other `RunResult` fields to compare."""
    keys = ("ttft_s", "itl_s", "end_s", "output_tokens", "finished", *more)
    assert [repr(getattr(a, k)) for k in keys] == [repr(getattr(b, k)) for k in keys]
    counters = ("preemptions", "prefix_hits", "prefix_queries", "steps")
    assert [getattr(a, k) for k in counters] == [getattr(b, k) for k in counters]


@pytest.mark.parametrize("policy", ["most_free_blocks", "kv_cost", "random"])
def test_decode_runs_give_exactly_the_one_step_at_a_time_run(policy: str) -> None:
    """Decode-only stretches simulated as `DecodeRun`s in bulk: the same TTFTs, ends,
    tokens, preemptions and prefix counters as stepping the engine one step at a time,
    on a pool small enough to preempt and with requests cut off at the end."""
    shape = ReplicaShape(num_blocks=120, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)
    reqs = list(skewed(40.0, 3.0, 0.2, (300, 900), (60, 200), (10, 80), (5, 60), seed=1))
    runs, busy = [], []
    for fuse in (False, True):
        fleet = Fleet(3, shape, STEP, stats_period_s=0.5, fuse_decode=fuse)
        runs.append(fleet.run(reqs, lambda f: POLICIES[policy](f, 0), 3.0, 0.5, max_drain_s=0.5))
        fleet.check_accounting()
        for r in fleet.replicas:  # a run's steps started by the cut-off (3.5 s), decided
            r.sync(3.5)
        busy.append([r.engine.stats(with_prefix=False).busy_budget_seconds for r in fleet.replicas])
    one, fused = runs
    # The compute use the autoscaler reads: each step's simulated seconds times its budget
    # share, summed per step or per run (the same terms, grouped differently).
    assert busy[1] == pytest.approx(busy[0], rel=1e-9) and min(busy[0]) > 0
    assert_same_run(one, fused, "arrival_s", "unfinished")
    assert one.preemptions > 0 and one.unfinished > 0  # both paths were exercised
    assert fused.step_calls < one.step_calls / 2


def test_the_autoscaler_in_the_loop_scales_out_serves_and_drains() -> None:
    """A burst on one small replica: the real policy scales out (its KV quantile past the
    target), the new replica serves after its start-up, and once the load is gone the
    fleet drains back to one; every request is served and every pool balances."""
    reqs = list(sinusoidal(multi_tenant(40.0, 60.0, 6, 96, 24, 40, 0), 2.0, 40.0, 60.0, 0))
    config = AutoscalingPolicyConfig(
        min_replicas=1,
        max_replicas=4,
        scale_out_after_s=2,
        scale_in_after_s=5,
        look_back_period_s=4,
        metrics_interval_s=1,
    )
    fleet = Fleet(1, SMALL, STEP, stats_period_s=0.5)
    result = fleet.run(
        reqs,
        lambda f: POLICIES["most_free_blocks"](f, 0),
        60.0,
        autoscale=SimAutoscale(config, startup_s=5.0),
    )
    fleet.check_accounting()
    assert result.unfinished == 0 and len(result.ttft_s) == len(reqs)
    events = [(e.old_target, e.new_target) for e in result.scale_events]
    assert events[0] == (1, 2) and events[-1][1] == 1
    first = result.scale_events[0].time_s
    # The new replica joins the routable set 5 s after the target rose, and takes traffic.
    joined = next(p.time_s for p in result.timeline if p.replicas == 2)
    assert joined == pytest.approx(first + 5.0, abs=1.0)
    assert fleet.replicas[1].engine.block_manager.prefix_cache_queries > 0
    assert result.timeline[-1].replicas == 1 and fleet.live == [0]
    assert all(p.target >= p.replicas for p in result.timeline if p.starting)


def test_a_scale_in_notice_warms_the_leavers_prompts_on_the_survivor() -> None:
    """Two replicas, busy (both take tenants), then quiet: the autoscaler announces the
    scale-in 4 s before it is due, most_free_blocks sends the newest replica's reused
    chains (three tenants' system prompts) to the other as warm-ups, one at a time, and
    routes the leaver nothing new; after the scale-in every request finds its system
    prompt cached. Warm-ups are not users' requests: not in the results."""
    # A busy first 10 s (both replicas take tenants), then a quiet 30 s.
    busy = list(multi_tenant(30.0, 10.0, 6, 96, 24, 60, seed=0))
    quiet = multi_tenant(3.0, 30.0, 6, 96, 24, 4, seed=1)
    reqs = busy + [
        dataclasses.replace(r, request_id=len(busy) + r.request_id, arrival_s=10.0 + r.arrival_s)
        for r in quiet
    ]
    config = AutoscalingPolicyConfig(
        min_replicas=1,
        max_replicas=2,
        scale_in_after_s=8,
        scale_in_notice_s=4,
        scale_in_kv_utilization=0.1,
        look_back_period_s=2,
        metrics_interval_s=1,
    )
    seen: list[tuple[float, int, int]] = []  # users' (arrival, replica, cached tokens)
    warmed: list[int] = []  # warm-ups' replicas

    class Recording(POLICIES["most_free_blocks"]):  # type: ignore[misc,valid-type]
        def on_completed(self, request, now):  # type: ignore[no-untyped-def]
            out = seen if not request.warm_up else None
            if out is not None:
                out.append((request.req.arrival_s, request.replica, request.seq.num_cached_tokens))
            else:
                warmed.append(request.replica)
            super().on_completed(request, now)

    fleet = Fleet(2, SMALL, STEP, stats_period_s=0.5)
    result = fleet.run(
        reqs, lambda f: Recording(f, 0), 40.0, autoscale=SimAutoscale(config, startup_s=5.0)
    )
    fleet.check_accounting()
    assert [(e.old_target, e.new_target) for e in result.scale_events] == [(2, 1)]
    gone = result.scale_events[0].time_s
    assert (result.warm_ups, warmed) == (3, [0, 0, 0])
    assert result.warm_up_tokens == 3 * 96  # the system prompts' 6 blocks each
    assert len(result.ttft_s) == len(seen) == len(reqs)
    # Under the notice nothing new reaches replica 1 (its three chains are warmed within
    # the first second of it); after the scale-in every system prompt is found cached.
    assert all(r == 0 for a, r, _ in seen if a >= gone - 3.0)
    assert all(cached >= 96 for a, _, cached in seen if a >= gone)


def test_the_protected_share_reaches_every_replicas_pool() -> None:
    shape = dataclasses.replace(SMALL, protected_fraction=0.25)
    fleet = Fleet(2, shape, STEP)
    assert [r.engine.block_manager._max_protected for r in fleet.replicas] == [64, 64]
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--prefix-cache-protected-fraction", "1.5"])
    args = parser.parse_args(["simulate", "--prefix-cache-protected-fraction", "0"])
    assert args.prefix_cache_protected_fraction == 0.0
    # The autoscaler's compute target: its setting's range, (0, 1].
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["simulate", "--target-compute-utilization", bad])
    args = parser.parse_args(["simulate", "--target-compute-utilization", "1"])
    assert args.target_compute_utilization == 1.0


def test_routing_fields_reach_the_policies_that_read_a_routing_config() -> None:
    fleet = Fleet(2, SMALL, STEP, stats_period_s=0.5)
    routing = {"affinity_owner_weight": 3.0, "prefill_weight": 2.0}
    mfb = policy_factory("most_free_blocks", 0, routing)(fleet)
    assert (mfb.config.affinity_owner_weight, mfb.config.prefill_weight) == (3.0, 2.0)
    # The variant keeps what makes it the variant; prefix-blind policies take nothing.
    free_only = policy_factory("most_free_blocks_free_only", 0, routing)(fleet)
    assert (free_only.config.affinity_owner_weight, free_only.config.prefill_weight) == (3.0, 0.0)
    assert policy_factory("round_robin", 0, routing)(fleet).name == "round_robin"
    assert policy_factory("most_free_blocks", 0)(fleet).config.affinity_owner_weight == 4.0


def _waiting_request(fleet: Fleet, replica: int, request_id: str, tokens: int) -> None:
    """A request queued on `replica`'s engine (not stepped: it waits)."""
    from pagefleet.engine import SamplingParams
    from pagefleet.engine.handoffs import EngineRequest

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 3 + tokens))
    fleet.replicas[replica].engine.add(EngineRequest(request_id, None, prompt, params, 0.0))


def _flight(fleet: Fleet, request_id: int, hashes: tuple[int, ...], tokens: int):
    from pagefleet.cluster.routing.policy import RouteRequest
    from pagefleet_lab.sim.fleet import InFlightRequest

    req = SimRequest(request_id, 0.0, (), tokens, request_id, 4)
    route = RouteRequest(str(request_id), tokens, 4, hashes, fleet.salt)
    return InFlightRequest(req, route, -1)


def test_load_only_reads_the_pickers_scrape_and_herds_within_it() -> None:
    """llm-d's load scorers on metrics scraped every 50 ms: the least-queued replica wins
    and keeps winning until the next scrape shows its queue."""
    fleet = Fleet(3, SMALL, STEP)
    policy = POLICIES["load_only"](fleet, 0)
    for i, replica in enumerate((0, 0, 1)):
        _waiting_request(fleet, replica, f"w{i}", 20)
    # Waiting 2, 1, 0; no KV used: queue scores 0, 0.5, 1.
    assert policy.choose(_flight(fleet, 1, (), 20), now=0.0) == 2
    for i in range(3):
        _waiting_request(fleet, 2, f"x{i}", 20)
    # 40 ms later the scrape is the same: r2 again, although it now has 3 waiting.
    assert policy.choose(_flight(fleet, 2, (), 20), now=0.04) == 2
    # The next scrape: waiting 2, 1, 3 -> queue scores 0.5, 1, 0.
    assert policy.choose(_flight(fleet, 3, (), 20), now=0.05) == 1


def test_the_pickers_default_profile_weighs_its_prefix_index_against_load() -> None:
    """approx_prefix_gie: 3 x the indexed prefix match + 2 x each load score; the index
    keeps the first 256 blocks of each prompt sent, LRU past its capacity."""
    fleet = Fleet(3, SMALL, STEP)
    policy = POLICIES["approx_prefix_gie"](fleet, 0)
    _waiting_request(fleet, 0, "w0", 20)
    _waiting_request(fleet, 1, "w1", 20)
    prompt = tuple(range(100, 110))  # 10 blocks
    assert policy.choose(_flight(fleet, 1, prompt, 160), now=0.0) == 2  # the only idle one
    assert list(policy.index[2]) == list(prompt)
    for i in range(2):
        _waiting_request(fleet, 2, f"x{i}", 20)
    # Now r2 has the longest queue (score 3 x 1.0 + 2 x (0 + 1) = 5) against r0 and r1
    # (0 + 2 x (1 + 1) = 4): the match still wins.
    assert policy.choose(_flight(fleet, 2, prompt, 160), now=0.1) == 2
    # Half the prompt matched (3 x 0.5 + 2 = 3.5) loses to an idle queue (4).
    half = prompt[:5] + tuple(range(200, 205))
    assert policy.choose(_flight(fleet, 3, half, 160), now=0.2) in (0, 1)
    # Only the first 256 blocks are indexed, and the index forgets the oldest first.
    policy.index_blocks = 12
    long = tuple(range(1000, 1300))
    chosen = policy.choose(_flight(fleet, 4, long, 300 * 16), now=0.3)
    assert list(policy.index[chosen])[-12:] == list(long[244:256])
    assert len(policy.index[chosen]) == 12
