"""`pagefleet-lab fairness`: the product's FairQueue driven inside the fleet simulator."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagefleet.cluster.fairness import FairQueue
from pagefleet_lab.cli import add_lab_parser, run_lab
from pagefleet_lab.sim.fairness import (
    HEAVY,
    LIGHT,
    FairGate,
    Setup,
    _Clock,
    run_mode,
    two_tenants,
)
from pagefleet_lab.sim.fleet import Fleet, ReplicaShape
from pagefleet_lab.sim.policies import policy_factory
from pagefleet_lab.sim.step_model import LinearStepModel

SMALL = ReplicaShape(num_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
STEP = LinearStepModel(0.005, 2e-5, 1e-4, 1e-7)


def setup() -> Setup:
    return Setup(2, SMALL, STEP, 6.0, 1.0, 30.0, 48, 24, 10.0, 0, 1 << 20)


def requests() -> list:
    # Well over what 2 replicas of 4 slots finish (each request ~24 steps of ~6 ms).
    return two_tenants(8.0, 10.0, 6.0, 48, 24, 0)


def test_the_gate_never_holds_more_than_its_slots_and_serves_every_request() -> None:
    reqs = requests()
    clock = _Clock()
    queue = FairQueue(8, 1 << 20, clock=clock)
    gate = FairGate(reqs, queue, clock)
    fleet = Fleet(2, SMALL, STEP)
    result = fleet.run(gate, policy_factory("most_free_blocks", 0), 6.0, 0.0, max_drain_s=60.0)
    fleet.check_accounting()
    assert sorted(result.request_ids) == sorted(r.request_id for r in reqs)
    assert all(result.finished)
    assert queue.in_flight == 0 and queue.waiting == 0
    # Every request left the queue at or after its arrival.
    assert all(gate.sent_at[r.request_id] >= r.arrival_s for r in reqs)
    assert any(gate.sent_at[r.request_id] > r.arrival_s for r in reqs)


def test_fair_queuing_serves_the_light_tenant_sooner_than_fcfs() -> None:
    reqs = requests()
    alone, fcfs, fair = (run_mode(setup(), mode, reqs) for mode in ("alone", "fcfs", "fair"))
    assert len(alone.ttft[LIGHT]) == len(fcfs.ttft[LIGHT]) == len(fair.ttft[LIGHT])
    assert alone.ttft[HEAVY] == []
    assert fair.p(LIGHT, 0.99) < fcfs.p(LIGHT, 0.99)
    assert fair.goodput(LIGHT) >= fcfs.goodput(LIGHT)
    # Deterministic for a seed.
    again = run_mode(setup(), "fair", reqs)
    assert again.ttft == fair.ttft


def test_the_command_writes_its_table_and_plot(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    out = tmp_path / "fair"
    args = parser.parse_args(
        [
            "fairness",
            "--replicas",
            "1",
            "--duration",
            "4",
            "--warmup",
            "1",
            "--drain",
            "30",
            "--prompt-tokens",
            "64",
            "--output-tokens",
            "16",
            "--max-num-seqs",
            "8",
            "--out",
            str(out),
        ]
    )
    assert run_lab(args) == 0
    text = out.with_suffix(".md").read_text()
    assert "| alone |" in text and "| fcfs |" in text and "| fair |" in text
    assert out.with_suffix(".png").exists()
