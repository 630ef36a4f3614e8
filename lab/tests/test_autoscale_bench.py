"""`pagefleet-lab autoscale`: the users' ramp, the timeline table and the scenarios."""

from __future__ import annotations

import argparse

from pagefleet.bench.client import RequestResult
from pagefleet.bench.metrics import parse_metrics
from pagefleet_lab.bench.autoscale import (
    Run,
    Sample,
    apply_scenario,
    replica_startups,
    startup_section,
    timeline_table,
    users_at,
)
from pagefleet_lab.cli import add_lab_parser


def test_users_ramp_up_hold_and_down() -> None:
    def at(t: float) -> int:
        return users_at(t, 9, 40, 20, 40)

    assert [at(t) for t in (0, 10, 20, 39.9)] == [1, 3, 5, 8]
    assert [at(t) for t in (40, 59.9)] == [9, 9]
    assert [at(t) for t in (60, 70, 99.9)] == [9, 7, 2]
    assert at(100) == at(500) == 1


def test_autoscale_timeline_finds_the_triggers_and_the_steps() -> None:
    args = argparse.Namespace(
        users=4, up_s=10, hold_s=20, down_s=10, min_replicas=1,
        target_kv_utilization=0.75, scale_in_kv_utilization=0.4, scale_in_after_s=10,
    )  # fmt: skip

    def sample(t: float, kv: float, waiting: float, target: float, replicas: float) -> Sample:
        return Sample(t, 1, replicas, target, kv, kv, int(replicas), 1, waiting)

    run = Run(
        samples=[
            sample(0, 0.1, 0, 1, 1),
            sample(5, 0.5, 5, 1, 1),  # more requests wait than tolerated: the first pressure
            sample(8, 0.8, 0, 2, 1),
            sample(14, 0.8, 0, 2, 2),  # the second replica serves
            sample(32, 0.3, 0, 2, 2),
            sample(34, 0.5, 0, 2, 2),
            sample(36, 0.2, 0, 2, 2),
            sample(50, 0.1, 0, 1, 2),
            sample(53, 0.1, 0, 1, 1),
        ],
        results=[RequestResult(ok=True, ttft=0.1, sent_at=1.0)],
        ramp_end=40.0,
    )
    rows, summary = timeline_table(run, args)
    got = {r[0].split(":")[0].split(" (")[0]: (r[1], r[2]) for r in rows}
    assert got["first pressure"] == ("5 s", "-")
    assert got["target replicas first above min"] == ("8 s", "+3 s")
    assert got["running replicas first above min"] == ("14 s", "+9 s")
    assert got["target back to min"] == ("50 s", "+10 s")
    assert got["running replicas back to min"] == ("53 s", "+13 s")
    assert "**errors: 0**" in summary[0]


def test_bench_autoscale_scenario_fills_only_the_flags_left_at_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    args = parser.parse_args(["autoscale", "--scenario", "saturated", "--hold-s", "30"])
    apply_scenario(args)
    assert (args.config, args.users, args.up_s, args.hold_s, args.down_s) == (
        "configs/local.yaml",
        32,
        0.0,
        30.0,  # given: kept
        0.0,
    )
    assert (args.prompt_tokens, args.output_tokens) == ([216, 216], [200, 200])
    plain = parser.parse_args(["autoscale"])
    apply_scenario(plain)
    assert (plain.config, plain.users, plain.prompt_tokens) == (None, 12, [32, 128])


def test_burst_scenario_is_384_requests_from_32_users() -> None:
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    args = parser.parse_args(["autoscale", "--scenario", "burst"])
    apply_scenario(args)
    assert (args.config, args.users, args.requests_per_user) == ("configs/local.yaml", 32, 12)
    assert (args.prompt_tokens, args.output_tokens) == ([216, 216], [200, 200])


def test_startup_section_times_each_phase_of_the_new_replica_from_the_load() -> None:
    page = "\n".join(
        [
            'pagefleet:replica_start_time_seconds{model_name="m",replica="old"} 900.0',
            'pagefleet:replica_start_time_seconds{model_name="m",replica="new"} 1007.5',
            *(
                f'pagefleet:replica_startup_seconds{{model_name="m",phase="{p}",replica="new"}} {s}'
                for p, s in (("ready", 0.5), ("process", 2.0), ("imports", 4.0))
            ),
            'pagefleet:replica_startup_seconds{model_name="m",phase="process",replica="old"} 9.0',
        ]
    )
    startups = replica_startups(parse_metrics(page + "\n"))
    assert [s.replica for s in startups] == ["old", "new"]
    new = startups[1]
    assert list(new.phases) == ["process", "imports", "ready"]  # in the order they run
    args = argparse.Namespace(min_replicas=1)
    run = Run(samples=[Sample(6.0, 32, 1, 2, 0.9, 0.9, 1, 32, 8)], t0_wall=1000.0)
    lines = startup_section(new, run, args)
    table = "\n".join(lines)
    assert "| placement: Serve starts the replica's process | 1.50 s | 7.5 s |" in table
    assert "| process | 2.00 s | 9.5 s |" in table
    assert "| ready | 0.50 s | 14.0 s |" in table
    assert "first request never after the load started" in lines[-1]
    new.phases["first_request"] = 1.0
    assert "first request 15 s after the load started" in startup_section(new, run, args)[-1]
