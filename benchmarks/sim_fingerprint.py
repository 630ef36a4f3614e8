"""A fingerprint of simulated fleet runs, to show a speed change left the results alone.

    python benchmarks/sim_fingerprint.py            # before the change, then after it

Runs `pagefleet-lab simulate`'s own setup (`simulate.setup_of`, `simulate.simulate`)
for four small fleets: 64 replicas at 1 QPS each for 120 s (the hour's shape, shortened),
16 replicas at 8 QPS each with most_free_blocks and power_of_two (the cap, the backlog and
spills come into play), and 4 replicas on skewed lengths. Each run's fingerprint is a
sha256 over every request's id, TTFT, ITL and end, the requests each replica was sent,
the fleet's prefix-cache counters and the engine steps: any change to a routing decision,
a step's timing or the cache's contents changes it. Every pool's block accounting is
checked too. The wall times are printed beside, but compare fingerprints, not those.
"""

from __future__ import annotations

import hashlib

from pagefleet_lab.cli import build_parser
from pagefleet_lab.sim import simulate

RUNS = [
    "--replicas 64 --qps 1 --duration 120 --warmup 20",
    "--replicas 16 --qps 8 --duration 60 --warmup 10 --policies most_free_blocks,power_of_two",
    "--replicas 4 --qps 4 --duration 60 --warmup 10 --workloads skewed",
]  # each a `bench simulate` command line


def fingerprints(argv: list[str]) -> list[str]:
    """One line per (workload, fleet size, rate, policy) that `argv` names."""
    args = build_parser().parse_args(
        ["simulate", "--qps-at", "", "--policies", "most_free_blocks", *argv]
    )
    simulate.fill_defaults(args, router=False)
    model = simulate.step_model(args, router=False)[0]
    shape = simulate.replica_shape(args)
    lines = []
    for workload in args.workloads.split(","):
        for n in (int(x) for x in args.replicas.split(",")):
            for qps in args.qps:
                setup = simulate.setup_of(args, workload, n, qps, shape, model)
                for policy in args.policies.split(","):
                    result, fleet = simulate.simulate(setup, policy)
                    fleet.check_accounting()
                    seen = (
                        result.request_ids,
                        result.ttft_s,
                        result.itl_s,
                        result.end_s,
                        sorted(result.routed.items()),
                        result.prefix_hits,
                        result.prefix_queries,
                        result.preemptions,
                        result.steps,
                    )
                    digest = hashlib.sha256(repr(seen).encode()).hexdigest()[:16]
                    lines.append(
                        f"{workload} n={n} qps={qps:g} {policy}: {digest} "
                        f"({len(result.ttft_s)} requests, {result.wall_s:.1f} s wall)"
                    )
                    print(lines[-1], flush=True)
    return lines


def main() -> None:
    for line in RUNS:
        fingerprints(line.split())


if __name__ == "__main__":
    main()
