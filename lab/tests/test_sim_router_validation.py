"""Issue 22's validation: bench router's workloads in the simulator (`sim_router`, the
closed loop), bench router's OUT.json, and the comparison (`sim_validation`)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from pagefleet.bench.client import RequestResult
from pagefleet.bench.metrics import Scrape
from pagefleet_lab.bench import router
from pagefleet_lab.bench.router_report import Outcome
from pagefleet_lab.cli import add_lab_parser, run_lab
from pagefleet_lab.sim import router_scenarios as sim_router
from pagefleet_lab.sim.fleet import Fleet
from pagefleet_lab.sim.policies import POLICIES
from pagefleet_lab.sim.step_model import (
    Fit,
    LinearStepModel,
    ScaledStepModel,
    StepShape,
    fit_linear,
)
from pagefleet_lab.sim.validation import (
    Row,
    agreeing_pairs,
    compare,
    order,
    read_markdown_table,
    read_rows,
    step_scale,
)
from pagefleet_lab.sim.workloads import ClosedLoop, Phase, SimRequest

SMALL = [
    "--skew-requests",
    "24",
    "--skew-users",
    "4",
    "--prefix-requests",
    "18",
    "--prefix-users",
    "3",
    "--warmup-per-user",
    "1",
    "--seed",
    "3",
]
# A step time of bench router's replicas' order (not a fit): 30 ms a step, 0.2 ms a
# prompt token, 3 ms a decoding sequence.
STEP = LinearStepModel(0.03, 2e-4, 3e-3, 2e-6)


def small_setup() -> tuple[argparse.Namespace, int, list[router.Scenario]]:
    rargs = router.router_args(SMALL)
    vocab = sim_router.vocab_size(argparse.Namespace(model="/nonexistent", preset=rargs.preset))
    return rargs, vocab, router.scenarios(rargs, vocab)


def test_the_closed_loop_sends_exactly_what_bench_router_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench router's own `_warm_up` and `measure`, their client replaced by a recorder:
    every phase's per-user lists (token ids, max_tokens, order) and start offsets are the
    simulator's phases'."""
    rargs, vocab, scens = small_setup()
    assert vocab == 49152  # the preset's, with no checkpoint there
    sends: list[tuple[list[list[tuple[tuple[int, ...], int]]], list[float]]] = []

    async def recorder(url, model, per_user, offsets, on_done=None, timeout_s=900.0):
        sends.append(([[(r.prompt, r.max_tokens) for r in u] for u in per_user], list(offsets)))
        results = [RequestResult(ok=True, tokens=r.max_tokens) for u in per_user for r in u]
        for res in results:
            if on_done is not None:
                on_done(res)
        return results, 1.0

    monkeypatch.setattr(router, "closed_loop", recorder)
    monkeypatch.setattr(router, "wait_idle", lambda url: Scrape())
    for scen in scens:
        sends.clear()
        router._warm_up("http://bench.invalid", "m", vocab, rargs.seed)
        router.measure("http://bench.invalid", "m", "round_robin", scen, rargs.ramp_s, 16)
        loop = sim_router.closed_loop(scen, rargs, vocab)
        simulated = [
            ([[(r.tokens, r.output_tokens) for r in u] for u in p.per_user], list(p.offsets))
            for p in loop.phases
        ]
        assert simulated == sends
        assert [p.measured for p in loop.phases] == [False, False, True]
        measured = loop.phases[2]
        assert sum(len(u) for u in measured.per_user) == len(scen.requests)
        assert measured.pause_before_s == sim_router.IDLE_PAUSE_S
        # Every prompt's token count and kind came through, user by user.
        for u, reqs in enumerate(measured.per_user):
            assert [r.prompt_tokens for r in reqs] == [
                len(b.prompt) for b in scen.requests[u :: scen.users]
            ]
            assert [r.kind for r in reqs] == [b.kind for b in scen.requests[u :: scen.users]]


class Recording:
    """A policy wrapper that notes when each request was routed and when it ended."""

    def __init__(self, inner, routed: dict[int, float], ended: dict[int, float]) -> None:
        self.inner, self.routed, self.ended = inner, routed, ended

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def choose(self, flight, now: float) -> int:
        self.routed[flight.req.request_id] = now
        return self.inner.choose(flight, now)

    def on_completed(self, flight, now: float) -> None:
        self.ended[flight.req.request_id] = now
        self.inner.on_completed(flight, now)


@pytest.mark.parametrize("policy", ["most_free_blocks", "approx_prefix_ray"])
def test_a_user_never_has_two_requests_in_flight_and_the_pools_balance(policy: str) -> None:
    rargs, vocab, scens = small_setup()
    for scen in scens:
        loop = sim_router.closed_loop(scen, rargs, vocab)
        fleet = Fleet(2, sim_router.replica_shape(rargs), STEP, 2.0)
        routed: dict[int, float] = {}
        ended: dict[int, float] = {}
        result = fleet.run(
            loop,
            lambda f: Recording(POLICIES[policy](f, 0), routed, ended),  # noqa: B023
            sim_router.GUARD_S,
            max_drain_s=0.0,
        )
        fleet.check_accounting()
        for r in fleet.replicas:
            bm = r.engine.block_manager
            assert bm.num_free_blocks == bm.num_total_blocks and r.unfinished == 0
        assert result.unfinished == 0 and all(result.finished)
        # Every request of every phase ran; only the measured ones count.
        assert len(routed) == len(ended) == sum(len(u) for p in loop.phases for u in p.per_user)
        assert sorted(result.request_ids) == sorted(
            r.request_id for u in loop.phases[2].per_user for r in u
        )
        # Per user (the fleet's own times): each request is routed when the one before
        # it ended (no think time), never earlier.
        for phase in loop.phases:
            for user in phase.per_user:
                ids = [r.request_id for r in user]
                for prev, nxt in itertools.pairwise(ids):
                    assert routed[nxt] == ended[prev]
        # The loop's log agrees: per user, sent and done alternate.
        state: dict[tuple[int, int], str] = defaultdict(lambda: "done")
        phase_of = {
            r.request_id: i for i, p in enumerate(loop.phases) for u in p.per_user for r in u
        }
        for _, user, rid, what in loop.log:
            key = (phase_of[rid], user)
            assert state[key] != what
            state[key] = what
        # The measured phase began after the pause, once the warm-up had ended.
        warm_end = max(ended[r.request_id] for p in loop.phases[:2] for u in p.per_user for r in u)
        assert loop.measured_start_s == pytest.approx(warm_end + sim_router.IDLE_PAUSE_S)
        assert min(result.arrival_s) == pytest.approx(loop.measured_start_s)
        assert sum(result.routed.values()) == len(result.request_ids)
    assert result.prefix_hits > 0  # the prefix scenario, last: its system prompts hit


def test_closed_loop_phases_skip_empty_ones_and_check_their_ids() -> None:
    a = SimRequest(0, 0.0, (), 4, 0, 2, tokens=(20, 21, 22, 23))
    b = SimRequest(1, 0.0, (), 4, 0, 2, tokens=(30, 31, 32, 33))
    loop = ClosedLoop([Phase((), ()), Phase(((a, b),), (0.5,), measured=True, pause_before_s=1)])
    first = loop.begin()
    assert [(r.request_id, r.arrival_s) for r in first] == [(0, 1.5)]
    assert loop.measured_start_s == 1.0 and not loop.done
    nxt = loop.finished(0, 2.0)
    assert [(r.request_id, r.arrival_s) for r in nxt] == [(1, 2.0)] and loop.done
    assert loop.finished(1, 3.0) == []
    with pytest.raises(ValueError, match="unique"):
        ClosedLoop([Phase(((a,),), (0.0,)), Phase(((a,),), (0.0,))])


def test_the_command_simulates_bench_routers_workloads(tmp_path: Path) -> None:
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps(fit_linear(*_exact(STEP), name="test").to_json()))
    out = tmp_path / "sim"
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    args = parser.parse_args(
        [
            "simulate",
            "--workloads",
            "router_skew,router_prefix",
            "--step-fit",
            str(fit),
            "--router-args",
            " ".join(SMALL),
            "--out",
            str(out),
        ]
    )
    assert run_lab(args) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["source"] == "simulated" and data["replicas"] == 2
    assert data["args"]["stand_ins"] == {"approx_prefix_ray": "prefix_cache_affinity"}
    rows = {(r["scenario"], r["policy"]) for r in data["rows"]}
    assert rows == {(s, p) for s in ("skew", "prefix") for p in sim_router.DEFAULT_POLICIES}
    assert all(r["ok"] == r["requests"] for r in data["rows"])
    assert {r["requests"] for r in data["rows"] if r["scenario"] == "skew"} == {24}
    text = out.with_suffix(".md").read_text()
    assert "`approx_prefix_ray` stands in for `prefix_cache_affinity`" in text
    assert "2048 tokens per step" in text and "128 KV blocks" in text
    assert out.with_suffix(".png").exists()


def _exact(model: LinearStepModel) -> tuple[list[StepShape], list[float]]:
    shapes = [
        StepShape(p, d, k, 0)
        for p, d, k in ((0, 1, 10), (64, 2, 200), (700, 0, 700), (0, 9, 900), (16, 5, 50))
    ]
    return shapes, [model.seconds(s) for s in shapes]


def test_a_fit_keeps_how_it_was_measured() -> None:
    fit = fit_linear(*_exact(STEP), engine={"contenders": 1, "num_threads": 1})
    again = Fit.from_json(json.loads(json.dumps(fit.to_json())))
    assert again == fit and again.engine == {"contenders": 1, "num_threads": 1}
    assert again.model.b == pytest.approx(STEP.b)


def test_bench_router_writes_its_rows_as_json(tmp_path: Path) -> None:
    from pagefleet_lab.bench.router_report import report

    rargs = router.router_args(SMALL)
    scens = router.scenarios(rargs, 49152)
    results = [
        RequestResult(ok=True, kind="short", ttft=t, e2e=2 * t, tokens=10) for t in (0.1, 0.2, 0.3)
    ] + [RequestResult(ok=False, kind="long", error="HTTP 500: x")]
    outcomes = [
        Outcome(p, s.name, results, 6.0, 1, 30, 60, 0.0, [2, 2])
        for s in scens
        for p in ("most_free_blocks", "round_robin")
    ]
    out = tmp_path / "router"
    report(outcomes, scens, argparse.Namespace(out=str(out), seed=3), ["notes"])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["source"] == "real" and data["args"] == {"out": str(out), "seed": 3}
    row = data["rows"][0]
    assert (row["scenario"], row["policy"], row["requests"], row["ok"]) == (
        "skew",
        "most_free_blocks",
        4,
        3,
    )
    assert row["ttft_p50"] == pytest.approx(0.2) and row["tok_s"] == pytest.approx(5.0)
    assert row["hit_rate"] == pytest.approx(0.5) and row["ttft_s"] == [0.1, 0.2, 0.3]
    assert read_rows(out.with_suffix(".md"))[1][0] == Row(
        "skew", "most_free_blocks", 0.2, pytest.approx(0.28), pytest.approx(0.298), 5.0, 0.5
    )


# -- the comparison ---------------------------------------------------------------------


def rows(scenario: str, values: dict[str, tuple[float, float]]) -> list[Row]:
    """(p50, p99) per policy; p90 between, tokens/s 10, no hit rate."""
    return [Row(scenario, p, a, (a + b) / 2, b, 10.0, math.nan) for p, (a, b) in values.items()]


def test_ratios_tolerance_and_stand_ins() -> None:
    real = rows("skew", {"most_free_blocks": (1.0, 4.0), "prefix_cache_affinity": (2.0, 8.0)})
    sim = rows("skew", {"most_free_blocks": (1.25, 3.0), "approx_prefix_ray": (1.49, 9.0)})
    c = compare(real, sim)
    by = {p.policy: p for p in c.pairs}
    assert by["most_free_blocks"].ratio_p50 == pytest.approx(1.25)
    assert by["most_free_blocks"].within()  # |1.25 - 1| = 0.25: on the bound, within
    assert by["prefix_cache_affinity"].sim_policy == "approx_prefix_ray"
    assert by["prefix_cache_affinity"].ratio_p50 == pytest.approx(0.745)
    assert not by["prefix_cache_affinity"].within()
    assert not c.all_within and not c.holds and c.unmatched == []
    assert compare(real, sim, tolerance=0.26).all_within


def test_the_step_scale_matches_tokens_per_second_on_one_scenario() -> None:
    real = [
        Row("skew", "most_free_blocks", 1.0, 1.0, 1.0, 50.0, math.nan),
        Row("skew", "round_robin", 1.0, 1.0, 1.0, 40.0, math.nan),
        Row("skew", "prefix_cache_affinity", 1.0, 1.0, 1.0, 10.0, math.nan),
        Row("prefix", "most_free_blocks", 1.0, 1.0, 1.0, 10.0, math.nan),
    ]
    sim = [
        Row("skew", "most_free_blocks", 1.0, 1.0, 1.0, 100.0, math.nan),  # 2x
        Row("skew", "round_robin", 1.0, 1.0, 1.0, 320.0, math.nan),  # 8x
        Row("skew", "approx_prefix_ray", 1.0, 1.0, 1.0, 99.0, math.nan),  # a stand-in: not read
        Row("prefix", "most_free_blocks", 1.0, 1.0, 1.0, 1000.0, math.nan),
    ]
    c = compare(real, sim)
    assert step_scale(c, "skew") == pytest.approx(4.0)  # sqrt(2 * 8)
    assert step_scale(c, "prefix") == pytest.approx(100.0)
    with pytest.raises(ValueError, match="no policy"):
        step_scale(c, "elsewhere")


def test_a_scaled_step_model_lengthens_every_step_by_its_factor() -> None:
    shape = StepShape(64, 2, 200, 0)
    scaled = ScaledStepModel(STEP, 1.5)
    assert scaled.seconds(shape) == pytest.approx(1.5 * STEP.seconds(shape))
    assert scaled.name == "linear x 1.5"
    with pytest.raises(ValueError, match="> 0"):
        ScaledStepModel(STEP, 0.0)


def test_rankings_by_p50_and_p99() -> None:
    real = rows("prefix", {"a": (0.5, 4.0), "b": (2.0, 8.0), "c": (2.2, 15.0)})
    same = rows("prefix", {"a": (0.3, 3.0), "b": (1.8, 9.0), "c": (2.3, 12.0)})
    c = compare(real, same)
    assert [(r.metric, r.same, r.agreeing_pairs, r.pairs) for r in c.rankings] == [
        ("p50", True, 3, 3),
        ("p99", True, 3, 3),
    ]
    assert c.ranks_same and not c.all_within  # a's p50 is 0.6x (b's 0.9x, c's 1.05x)
    swapped = rows("prefix", {"a": (0.5, 4.0), "b": (2.1, 16.0), "c": (2.0, 8.0)})
    c = compare(real, swapped)
    p50, p99 = c.rankings
    assert p50.real == ("a", "b", "c") and p50.sim == ("a", "c", "b") and not p50.same
    assert (p50.agreeing_pairs, p99.agreeing_pairs) == (2, 2)
    assert all(p.within() for p in c.pairs) and not c.holds
    assert compare(real, real).holds


def test_order_and_pair_agreement_handle_ties_and_nan() -> None:
    assert order({"b": 1.0, "a": 1.0, "c": math.nan, "d": 0.5}) == ("d", "a", "b", "c")
    assert agreeing_pairs({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 2.0}) == (0, 1)
    assert agreeing_pairs({"a": 1.0, "b": 1.0}, {"a": 3.0, "b": 3.0}) == (1, 1)


def test_unmatched_rows_are_left_out_and_named() -> None:
    real = rows("skew", {"a": (1.0, 2.0), "b": (1.0, 2.0)})
    sim = rows("skew", {"a": (1.0, 2.0), "z": (1.0, 2.0)}) + rows("prefix", {"a": (1.0, 2.0)})
    c = compare(real, sim)
    assert [p.policy for p in c.pairs] == ["a"]
    assert c.unmatched == ["simulated: skew z", "simulated: prefix a", "real: skew b"]
    assert c.rankings == [] and not c.holds  # one policy per scenario ranks nothing


def test_the_markdown_table_of_an_older_bench_router_report() -> None:
    text = """# Routing policies on 2 replicas

| scenario | policy | ok | output tok/s | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | e2e p50 (s) | preemptions | prefix-hit rate | router expected | requests per replica |
|---|---|---|---|---|---|---|---|---|---|---|---|
| skew | most_free_blocks | 192/192 | 59.1 | 0.445 | 0.916 | 3.900 | 5.75 | 0 | 0.0% | 0.0% | 107 / 85 |
| prefix | round_robin | 144/144 | 37.6 | 2.270 | 11.212 | 14.931 | 7.35 | 9 | - | - | 72 / 72 |

(a) by request kind:

| policy | short requests | long requests |
"""
    got = read_markdown_table(text)
    assert got[0] == Row("skew", "most_free_blocks", 0.445, 0.916, 3.9, 59.1, 0.0)
    assert got[1].policy == "round_robin" and math.isnan(got[1].hit_rate) and len(got) == 2


def test_the_validation_script_writes_its_report(tmp_path: Path) -> None:
    from pagefleet_lab.bench.router_report import result_row, write_rows_json
    from pagefleet_lab.sim.validation import main

    def run(source: str, scale: float, name: str) -> Path:
        out = tmp_path / source
        rr = [
            result_row(
                "skew",
                p,
                [scale * t * k for t in (0.1, 0.2, 0.3)],
                ["short"] * 3,
                3,
                30,
                3.0,
                0,
                math.nan,
                [2, 1],
            )
            for k, p in ((1, "most_free_blocks"), (2, "round_robin"), (3, name))
        ]
        write_rows_json(out, source, rr)
        return out.with_suffix(".json")

    real = run("real", 1.0, "prefix_cache_affinity")
    sim = run("simulated", 1.1, "approx_prefix_ray")
    out = tmp_path / "validation"
    assert main(["--real", str(real), "--sim", str(sim), "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    assert "**The validation holds**: 3 of 3" in text
    assert "prefix_cache_affinity (sim: approx_prefix_ray, a stand-in)" in text
    assert out.with_suffix(".png").exists()
    assert json.loads(out.with_suffix(".json").read_text())["holds"] is True
    with pytest.raises(SystemExit, match="--real takes"):
        main(["--real", str(sim), "--sim", str(real), "--out", str(out)])
