"""`pagefleet-lab router-cost`, tiny: the timings and the table's shape."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagefleet_lab.bench.router_cost import HEADER, ROUTING, Workload, measure
from pagefleet_lab.cli import add_lab_parser, run_lab


def test_measure_times_every_decision_and_chooses_alike_when_seeded_alike() -> None:
    work = Workload.make(18, 256, 16, 16, 2, seed=0)
    assert {len(p) for p in work.prompts} == {256 // 16}
    assert len(set(work.prompts)) == 18  # each request's own half differs
    t = measure(ROUTING, work, replicas=3, in_flight=8, decisions=10, seed=0)
    assert (len(t.step_ns), len(t.choose_ns), len(t.choices)) == (10, 10, 18)
    assert all(c >= 0 for c in t.choose_ns)
    assert all(s >= c for s, c in zip(t.step_ns, t.choose_ns, strict=True))
    assert set(t.choices) <= {"r0", "r1", "r2"}
    # Seeded: the same choices again.
    assert (
        measure(ROUTING, work, replicas=3, in_flight=8, decisions=10, seed=0).choices == t.choices
    )


def test_the_command_writes_one_row_per_replica_count_and_code(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    out = tmp_path / "router_cost"
    args = parser.parse_args(
        [
            "router-cost",
            "--replicas",
            "2,4",
            "--in-flight",
            "8",
            "--decisions",
            "10",
            "--prompt-tokens",
            "512",
            "--out",
            str(out),
        ]
    )
    assert run_lab(args) == 0
    text = out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").exists()
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(HEADER) + " |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("2", "8", "32", "this checkout"),
        ("4", "8", "32", "this checkout"),
    ]
    assert all(float(c) >= 0 for r in rows for c in r[4:])
