"""Issue 22's validation: a real `pagefleet-lab router` run beside the simulator's run of
the same workloads (`bench simulate --workloads router_skew,router_prefix`, `sim_router`).

    .venv/bin/python benchmarks/sim_validation.py --real benchmarks/results/router_validation.json \\
        --sim benchmarks/results/sim_router_validation.json --out benchmarks/results/sim_validation

The inputs are the OUT.json both commands write (`router_report.write_rows_json`: one row
per scenario and policy); a .md path reads the .json beside it or, for a bench router
report from before it wrote one, the report's table (`read_markdown_table`).

Each simulated policy is compared with the real one it is, or stands in for
(`sim_router.STAND_INS`: approx_prefix_ray for prefix_cache_affinity), on the same
scenario. Per pair: TTFT p50, p90 and p99, output tokens/s and prefix-cache hit rate,
real and simulated, and the ratio simulated / real of p50 with whether it is within the
tolerance (`|ratio - 1| <= 0.25`, the issue's). Per scenario: whether the policies rank
the same way by p50 and by p99 (ascending, over the policies both runs have), and how
many of the pairs of policies are in the same order in both (one swap of two near-equal
policies reads differently from a reversal). The verdict holds when every ratio is
within the tolerance and every ranking is the same; if it does not, the step model (or
what the simulator leaves out) is to be fixed before a larger simulated figure is read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet_lab.sim.router_scenarios import real_policy

TOLERANCE = 0.25  # the issue's: simulated p50 TTFT within 25% of real


@dataclass(frozen=True)
class Row:
    """One policy on one scenario in one run (NaN where the run has no figure)."""

    scenario: str
    policy: str
    p50: float
    p90: float
    p99: float
    tok_s: float
    hit_rate: float


@dataclass(frozen=True)
class Pair:
    """A real row and the simulated row of the policy that is (or stands in for) it."""

    scenario: str
    policy: str  # bench router's name
    sim_policy: str
    real: Row
    sim: Row

    @property
    def ratio_p50(self) -> float:
        return _ratio(self.sim.p50, self.real.p50)

    def within(self, tolerance: float = TOLERANCE) -> bool:
        return abs(self.ratio_p50 - 1.0) <= tolerance  # False for NaN


@dataclass(frozen=True)
class Ranking:
    """The policies of one scenario ordered by one statistic (lowest first), both runs."""

    scenario: str
    metric: str  # "p50" or "p99"
    real: tuple[str, ...]
    sim: tuple[str, ...]
    agreeing_pairs: int
    pairs: int

    @property
    def same(self) -> bool:
        return self.real == self.sim


@dataclass(frozen=True)
class Comparison:
    pairs: list[Pair]
    rankings: list[Ranking]
    tolerance: float
    unmatched: list[str]  # "real/sim: scenario policy" rows with no counterpart

    @property
    def all_within(self) -> bool:
        return bool(self.pairs) and all(p.within(self.tolerance) for p in self.pairs)

    @property
    def ranks_same(self) -> bool:
        return bool(self.rankings) and all(r.same for r in self.rankings)

    @property
    def holds(self) -> bool:
        return self.all_within and self.ranks_same


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def _num(x: object) -> float:
    return math.nan if x is None else float(x)  # type: ignore[arg-type]


# -- reading ----------------------------------------------------------------------------


def read_rows(path: str | Path) -> tuple[str, list[Row]]:
    """(source, rows) of a run: its OUT.json, or a .md's sibling .json, or the .md's
    table (`read_markdown_table`) when it has none."""
    path = Path(path)
    js = path.with_suffix(".json")
    if js.is_file():
        data = json.loads(js.read_text())
        rows = [
            Row(
                r["scenario"],
                r["policy"],
                _num(r["ttft_p50"]),
                _num(r["ttft_p90"]),
                _num(r["ttft_p99"]),
                _num(r["tok_s"]),
                _num(r["hit_rate"]),
            )
            for r in data["rows"]
        ]
        return str(data.get("source", "")), rows
    if path.suffix == ".md" and path.is_file():
        return "", read_markdown_table(path.read_text())
    raise SystemExit(f"{path}: no OUT.json beside it, and not a bench router report")


def read_markdown_table(text: str) -> list[Row]:
    """The rows of bench router's table (header `| scenario | policy | ok | ...`): the
    columns read by name; "-" is NaN, a hit rate "93.5%" 0.935."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _cells(line)[:3] == ["scenario", "policy", "ok"]]
    if not starts:
        raise ValueError("no bench router table (| scenario | policy | ok | ...)")
    i = starts[0]
    header = _cells(lines[i])
    col = {name: header.index(name) for name in header}

    def value(cells: list[str], name: str) -> float:
        text = cells[col[name]].rstrip("%")
        if text in ("-", "", "nan"):
            return math.nan
        return float(text) / (100 if cells[col[name]].endswith("%") else 1)

    rows = []
    for line in lines[i + 2 :]:
        cells = _cells(line)
        if len(cells) != len(header):
            break
        rows.append(
            Row(
                cells[col["scenario"]],
                cells[col["policy"]],
                value(cells, "TTFT p50 (s)"),
                value(cells, "TTFT p90 (s)"),
                value(cells, "TTFT p99 (s)"),
                value(cells, "output tok/s"),
                value(cells, "prefix-hit rate"),
            )
        )
    return rows


def _cells(line: str) -> list[str]:
    line = line.strip()
    if not line.startswith("|"):
        return []
    return [c.strip() for c in line.strip("|").split("|")]


# -- comparing --------------------------------------------------------------------------


def order(values: dict[str, float]) -> tuple[str, ...]:
    """Policies by value, lowest (best) first; ties, and NaN last, by name."""
    return tuple(sorted(values, key=lambda p: (math.isnan(values[p]), values[p], p)))


def agreeing_pairs(a: dict[str, float], b: dict[str, float]) -> tuple[int, int]:
    """(pairs of policies in the same order in both, pairs): the same order means the
    same sign of the difference (ties agree only with ties)."""

    def sign(x: float) -> int:
        return (x > 0) - (x < 0)

    names = sorted(a)
    agree = total = 0
    for p, q in itertools.combinations(names, 2):
        total += 1
        agree += sign(a[p] - a[q]) == sign(b[p] - b[q])
    return agree, total


def compare(real: Sequence[Row], sim: Sequence[Row], tolerance: float = TOLERANCE) -> Comparison:
    """Pairs, per-scenario rankings and the verdict (module docstring)."""
    real_by = {(r.scenario, r.policy): r for r in real}
    pairs: list[Pair] = []
    matched: set[tuple[str, str]] = set()
    unmatched: list[str] = []
    for s in sim:
        key = (s.scenario, real_policy(s.policy))
        r = real_by.get(key)
        if r is None or key in matched:
            unmatched.append(f"simulated: {s.scenario} {s.policy}")
            continue
        matched.add(key)
        pairs.append(Pair(s.scenario, key[1], s.policy, r, s))
    unmatched += [f"real: {sc} {p}" for sc, p in real_by if (sc, p) not in matched]
    rankings = []
    for scenario in dict.fromkeys(p.scenario for p in pairs):
        mine = [p for p in pairs if p.scenario == scenario]
        if len(mine) < 2:
            continue
        for metric in ("p50", "p99"):
            a = {p.policy: getattr(p.real, metric) for p in mine}
            b = {p.policy: getattr(p.sim, metric) for p in mine}
            agree, total = agreeing_pairs(a, b)
            rankings.append(Ranking(scenario, metric, order(a), order(b), agree, total))
    return Comparison(pairs, rankings, tolerance, unmatched)


def step_scale(c: Comparison, scenario: str) -> float:
    """The `--step-scale` that matches the simulator's output tokens/s to real on
    `scenario`: the geometric mean over its policies of simulated / real tokens/s.

    In a closed loop every request's time is a sum of step times, so steps `s` times
    longer make the fleet's throughput `s` times lower (to first order): the factor is
    the share of the cores the serving stack took from the engines in the real run. It
    is measured on one scenario and checked on the others (held out)."""
    ratios = [
        _ratio(p.sim.tok_s, p.real.tok_s)
        for p in c.pairs
        if p.scenario == scenario and p.sim_policy == p.policy
    ]
    ratios = [r for r in ratios if not math.isnan(r) and r > 0]
    if not ratios:
        raise ValueError(f"no policy with tokens/s in both runs on scenario {scenario!r}")
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


# -- the report -------------------------------------------------------------------------


def _f(x: float, spec: str = ".3f") -> str:
    return "-" if math.isnan(x) else format(x, spec)


def _label(p: Pair) -> str:
    return p.policy if p.sim_policy == p.policy else f"{p.policy} (sim: {p.sim_policy}, a stand-in)"


def render(c: Comparison) -> str:
    tol = f"{100 * c.tolerance:g}%"
    rows = [
        [
            p.scenario,
            _label(p),
            _f(p.real.p50),
            _f(p.sim.p50),
            f"**{_f(p.ratio_p50, '.2f')}**",
            "yes" if p.within(c.tolerance) else "**no**",
            _f(p.real.p90),
            _f(p.sim.p90),
            _f(p.real.p99),
            _f(p.sim.p99),
            _f(_ratio(p.sim.p99, p.real.p99), ".2f"),
            _f(p.real.tok_s, ".1f"),
            _f(p.sim.tok_s, ".1f"),
            _f(_ratio(p.sim.tok_s, p.real.tok_s), ".2f"),
            _f(100 * p.real.hit_rate, ".1f"),
            _f(100 * p.sim.hit_rate, ".1f"),
        ]
        for p in c.pairs
    ]
    table = markdown_table(
        [
            "scenario",
            "policy",
            "p50 real (s)",
            "p50 sim (s)",
            "p50 sim/real",
            f"within {tol}",
            "p90 real",
            "p90 sim",
            "p99 real",
            "p99 sim",
            "p99 sim/real",
            "tok/s real",
            "tok/s sim",
            "tok/s sim/real",
            "hit % real",
            "hit % sim",
        ],
        rows,
    )
    ranks = markdown_table(
        ["scenario", "by", "real (best first)", "simulated (best first)", "same", "pairs agreeing"],
        [
            [
                r.scenario,
                f"TTFT {r.metric}",
                " < ".join(r.real),
                " < ".join(r.sim),
                "yes" if r.same else "**no**",
                f"{r.agreeing_pairs}/{r.pairs}",
            ]
            for r in c.rankings
        ],
    )
    within = sum(p.within(c.tolerance) for p in c.pairs)
    verdict = (
        f"**The validation {'holds' if c.holds else 'does not hold'}**: {within} of "
        f"{len(c.pairs)} simulated p50 TTFTs within {tol} of real; the policies rank the "
        f"same way in {sum(r.same for r in c.rankings)} of {len(c.rankings)} rankings."
    )
    if not c.holds:
        verdict += (
            " Fix the model (the step fit, or what the simulator leaves out: the serving "
            "stack's time and CPU) before trusting a larger simulated figure."
        )
    notes = []
    if any(p.sim_policy != p.policy for p in c.pairs):
        notes.append(
            "A stand-in is a re-implementation (sim_policies.ApproxPrefixRay: Ray's "
            "defaults over block hashes), not the real router's code."
        )
    if c.unmatched:
        notes.append("Rows with no counterpart (left out): " + "; ".join(c.unmatched) + ".")
    return "\n".join([verdict, "", table, "", "Rankings:", "", ranks, "", *notes])


def plot(c: Comparison, out: str | Path) -> None:
    plt = pyplot()
    scenarios = list(dict.fromkeys(p.scenario for p in c.pairs))
    fig, axes = plt.subplots(
        max(1, len(scenarios)), 3, figsize=(15, 3.8 * max(1, len(scenarios))), squeeze=False
    )
    for row, scenario in zip(axes, scenarios, strict=False):
        mine = [p for p in c.pairs if p.scenario == scenario]
        x = list(range(len(mine)))
        w = 0.38
        for ax, title, get in (
            (row[0], "TTFT p50 (s)", lambda r: r.p50),
            (row[1], "TTFT p99 (s)", lambda r: r.p99),
            (row[2], "output tokens/s", lambda r: r.tok_s),
        ):
            ax.bar([i - w / 2 for i in x], [get(p.real) for p in mine], w, label="real")
            ax.bar([i + w / 2 for i in x], [get(p.sim) for p in mine], w, label="simulated")
            ax.set_xticks(x, [p.policy for p in mine], fontsize=7, rotation=15)
            ax.set_title(f"{scenario}: {title}", fontsize=9)
            ax.grid(alpha=0.3)
        for i, p in enumerate(mine):  # the p50 ratio over its pair of bars
            top = max((v for v in (p.real.p50, p.sim.p50) if not math.isnan(v)), default=0.0)
            color = "tab:green" if p.within(c.tolerance) else "tab:red"
            row[0].annotate(
                f"{_f(p.ratio_p50, '.2f')}x",
                (i, top),
                ha="center",
                va="bottom",
                fontsize=8,
                color=color,
            )
        row[0].legend(fontsize=8)
    save_png(fig, out, 100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/sim_validation.py",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--real", required=True, help="bench router's OUT.json (or its .md)")
    parser.add_argument("--sim", required=True, help="bench simulate --workloads router_...'s")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--out", default="benchmarks/results/sim_validation")
    parser.add_argument(
        "--calibrate",
        metavar="SCENARIO",
        help="print the --step-scale that matches tokens/s on SCENARIO (`step_scale`) and stop",
    )
    parser.add_argument(
        "--calibrated-on",
        metavar="SCENARIO",
        help="the scenario the simulated run's --step-scale was measured on (said in the report)",
    )
    args = parser.parse_args(argv)
    real_source, real = read_rows(args.real)
    sim_source, sim = read_rows(args.sim)
    if real_source == "simulated" or sim_source == "real":
        raise SystemExit("--real takes bench router's run, --sim the simulator's")
    c = compare(real, sim, args.tolerance)
    if args.calibrate:
        print(f"--step-scale {step_scale(c, args.calibrate):.3f}  (tokens/s on {args.calibrate})")
        return 0
    calibration = (
        f" The simulated run's step times were scaled to match real tokens/s on "
        f"`{args.calibrated_on}` (`--step-scale`, `step_scale`): the other scenarios are "
        "held out."
        if args.calibrated_on
        else ""
    )
    body = "\n".join(
        [
            f"Real: `{args.real}`; simulated: `{args.sim}`. Ratios are simulated / real; "
            f"TTFT in seconds; hit % of prompt tokens. Per scenario, the policies both runs "
            "have, ordered by TTFT (best first)." + calibration,
            "",
            render(c),
        ]
    )
    plot(c, args.out)
    path = write_report(
        args.out,
        "Simulator against real Serve: bench router's workloads",
        body,
        command="python benchmarks/sim_validation.py "
        + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
    )
    Path(args.out).with_suffix(".json").write_text(
        json.dumps(
            {
                "holds": c.holds,
                "tolerance": c.tolerance,
                "pairs": [
                    asdict(p) | {"ratio_p50": p.ratio_p50, "within": p.within(c.tolerance)}
                    for p in c.pairs
                ],
                "rankings": [asdict(r) | {"same": r.same} for r in c.rankings],
                "unmatched": c.unmatched,
            },
            indent=1,
        )
        + "\n"
    )
    print(path.read_text())
    return 0 if c.holds else 1
