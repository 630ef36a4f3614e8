"""Where each tenant's requests went around the scale events of `pagefleet-lab simulate
--autoscale`: the same run (its report written as the command writes it), with every
routing choice recorded.

    .venv/bin/python benchmarks/sim_scale_events.py benchmarks/results/sim_scale_events \\
        --autoscale 2:8 --qps 4 --duration 480 --period 240 --warmup 0 \\
        --policies most_free_blocks --out /tmp/simulate_autoscale

The arguments after the first are `pagefleet-lab simulate`'s (one policy). Writes
FIRST.json: per replica that left, the tenants whose last request in the 120 s before
went to it ("the leaver's") and, over the `--event-window` after, how many replicas each
such tenant was routed to, beside the same for every other tenant seen in those 120 s
(scatter that is the policy's everyday behaviour, not the event's); per replica that
joined, its share of the requests in its first 10 s; and, where the policy hands off
(`routing.scale_in.hand_off_and_retain`), how many prompt chains each leaver owned and how
many were handed to a survivor that held them. `PF_ROUTING='{"affinity_memory_blocks":
1048576}'` runs most_free_blocks with those `RoutingConfig` fields. Works against any
checkout whose `pagefleet` is first on the path (a before/after of the policy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pagefleet.bench.report as report
import pagefleet.cluster.routing.router as routing_router
import pagefleet_lab.sim.simulate as simulate
from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet_lab.cli import add_lab_parser, run_lab

Choice = tuple[float, str, str]  # (time, tenant, replica id)


class Recorder:
    """A policy that records every choice and replica-set change of the one it wraps."""

    def __init__(self, inner: Any, choices: list[Choice], live: list[tuple[float, list[str]]]):
        self.inner, self.choices, self.live = inner, choices, live
        live.append((0.0, self._ids()))

    def _ids(self) -> list[str]:
        fleet = self.inner.fleet
        return [fleet.replicas[i].id for i in fleet.live]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def choose(self, flight: Any, now: float) -> int:
        idx: int = self.inner.choose(flight, now)
        self.choices.append((now, flight.req.kind, self.inner.fleet.replicas[idx].id))
        return idx

    def on_replicas(self, now: float) -> None:
        self.inner.on_replicas(now)
        self.live.append((now, self._ids()))


def spread(tenants: set[str], after: list[Choice]) -> dict[str, float]:
    """How many of `tenants` were routed in `after`, to how many replicas each (mean), and
    how many to more than one."""
    dest: dict[str, set[str]] = defaultdict(set)
    for _, tenant, rid in after:
        if tenant in tenants:
            dest[tenant].add(rid)
    n = [len(v) for v in dest.values()]
    return {
        "tenants": len(n),
        "replicas_per_tenant": round(sum(n) / max(len(n), 1), 2),
        "on_2_or_more": sum(1 for x in n if x > 1),
    }


def analyse(
    choices: list[Choice], live: list[tuple[float, list[str]]], window_s: float
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"left": [], "joined": []}
    for (_, before), (at, now_live) in itertools.pairwise(live):
        gone, new = set(before) - set(now_live), set(now_live) - set(before)
        last: dict[str, str] = {}
        for t, tenant, rid in choices:
            if at - 120 <= t < at:
                last[tenant] = rid
        after = [c for c in choices if at <= c[0] < at + window_s]
        if gone:
            mine = {tenant for tenant, rid in last.items() if rid in gone}
            out["left"].append(
                {
                    "at_s": round(at, 1),
                    "replicas": sorted(gone),
                    "leaver_tenants": spread(mine, after),
                    "other_tenants": spread(set(last) - mine, after),
                }
            )
        if new:
            first = [c for c in after if c[0] < at + 10]
            out["joined"].append(
                {
                    "at_s": round(at, 1),
                    "replicas": sorted(new),
                    "share_of_first_10_s": round(
                        sum(1 for c in first if c[2] in new) / max(len(first), 1), 3
                    ),
                }
            )
    return out


def main(argv: list[str]) -> int:
    stats_out, *rest = argv
    parser = argparse.ArgumentParser()
    add_lab_parser(parser)
    args = parser.parse_args(["simulate", *rest])
    (name,) = [p for p in args.policies.split(",") if p]
    choices: list[Choice] = []
    live: list[tuple[float, list[str]]] = []
    fields = json.loads(os.environ.get("PF_ROUTING", "{}"))
    make = simulate.POLICIES[name]

    def recorded(fleet: Any, seed: int) -> Recorder:
        inner = make(fleet, seed, RoutingConfig(**fields)) if fields else make(fleet, seed)  # type: ignore[call-arg]
        return Recorder(inner, choices, live)

    simulate.POLICIES[name] = recorded
    hand_offs: list[dict[str, Any]] = []
    real: Callable[..., Any] | None = getattr(routing_router, "hand_off_and_retain", None)
    if real is not None:

        def spy(state: Any, survivors: Any, config: Any, rng: Any, now: float) -> Any:
            ids = {ld.replica_id for ld in survivors}
            owned = {r: len(state.owned_chains(r)) for r in state.owning_replicas() if r not in ids}
            plan = real(state, survivors, config, rng, now)
            if owned:
                handed = {r: len(c) for r, c in plan.items()}
                hand_offs.append({"at_s": round(now, 1), "owned_chains": owned, "handed": handed})
            return plan

        routing_router.hand_off_and_retain = spy  # type: ignore[attr-defined]
    # The report's header names this command, not `pagefleet-lab simulate`.
    env = f"PF_ROUTING={shlex.quote(os.environ['PF_ROUTING'])} " if fields else ""
    line = " ".join(shlex.quote(a) for a in argv)
    report.command_line = lambda: f"{env}python benchmarks/sim_scale_events.py {line}"
    rc = run_lab(args)
    stats: dict[str, Any] = {**analyse(choices, live, args.event_window), "hand_offs": hand_offs}
    with open(f"{stats_out}.json", "w") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")
    print(json.dumps(stats, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
