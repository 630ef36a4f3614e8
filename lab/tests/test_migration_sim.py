"""`pagefleet-lab migration`: replicas killed or scaled in mid-run, with and without
migration, in the fleet simulator."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagefleet_lab.cli import add_lab_parser, run_lab
from pagefleet_lab.sim.fleet import ReplicaShape, RunResult
from pagefleet_lab.sim.migration import Setup, run_one
from pagefleet_lab.sim.step_model import LinearStepModel

SMALL = ReplicaShape(num_blocks=512, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
STEP = LinearStepModel(0.005, 2e-5, 1e-4, 1e-7)


def setup() -> Setup:
    # 4 replicas, 2 of them leave at 2 s holding 14 requests (200 steps of ~6 ms each).
    return Setup(4, SMALL, STEP, 24.0, 4.0, 2.0, 2, 0.1, 60.0, 8, 64, 16, 200, 0)


def finished(r: RunResult) -> set[int]:
    return {rid for rid, ok in zip(r.request_ids, r.finished, strict=True) if ok}


def test_a_kill_without_migration_fails_exactly_the_killed_replicas_requests() -> None:
    s = setup()
    reqs = s.requests()
    r = run_one(s, "kill", False, reqs)
    stranded = set(r.stranded)
    assert len(r.stranded) == len(stranded) == 14
    assert sorted(r.failed) == sorted(stranded)
    assert r.moved == [] and r.unfinished == 0
    assert finished(r) == {q.request_id for q in reqs} - stranded
    assert sorted(r.removed_s) == [2, 3] and set(r.removed_s.values()) == {2.0}


def test_a_kill_with_migration_completes_every_request_once() -> None:
    s = setup()
    reqs = s.requests()
    r = run_one(s, "kill", True, reqs)
    assert r.failed == [] and r.unfinished == 0
    assert sorted(r.moved) == sorted(r.stranded) and len(r.stranded) == 14
    assert sorted(r.request_ids) == sorted(q.request_id for q in reqs)
    assert all(r.finished)
    # Every request made all its tokens, the moved ones over two replicas.
    assert r.output_tokens == [s.output_tokens] * len(reqs)
    # Each move resumes after a stall: its continuation's routing, queueing and prefill.
    assert len(r.resume_gap_s) == 14 and all(g > 0 for g in r.resume_gap_s)
    # Each move is routed again, to a survivor.
    assert sum(r.routed.values()) == len(reqs) + 14
    # Deterministic for a seed.
    again = run_one(s, "kill", True, reqs)
    assert again.ttft_s == r.ttft_s and again.end_s == r.end_s


def test_a_scale_in_drains_without_migration_and_cuts_after_the_drain_with_it() -> None:
    s = setup()
    reqs = s.requests()
    drained = run_one(s, "scale_in", False, reqs)
    moved = run_one(s, "scale_in", True, reqs)
    for r in (drained, moved):
        assert r.failed == [] and r.unfinished == 0 and all(r.finished)
        assert sorted(r.request_ids) == sorted(q.request_id for q in reqs)
        assert len(r.stranded) == 14
    assert drained.moved == []
    assert all(t > s.fault_s + s.drain_s for t in drained.removed_s.values())
    assert set(moved.removed_s.values()) == {s.fault_s + s.drain_s}
    # 2 of the 14 finished within the drain, the other 12 moved.
    assert len(moved.moved) == 12 and set(moved.moved) < set(moved.stranded)


def test_the_command_writes_its_table_and_plot(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    out = tmp_path / "mig"
    args = parser.parse_args(
        [
            "migration",
            "--replicas",
            "4",
            "--faulted",
            "1",
            "--qps",
            "4",
            "--duration",
            "4",
            "--fault-at",
            "2",
            "--output-tokens",
            "32",
            "--out",
            str(out),
        ]
    )
    assert run_lab(args) == 0
    text = out.with_suffix(".md").read_text()
    for label in ("kill, no migration", "kill, migration", "scale-in, no migration"):
        assert f"| {label} |" in text
    assert out.with_suffix(".png").exists()
