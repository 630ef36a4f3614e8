"""What a `bench soak` run collected, and what it says: RSS growth per process role
(fitted per process after the warm-up), latency in the first and last fifths, and the
report (`benchmarks/results/soak.md` + `.png`)."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile, slope
from pagefleet_lab.bench.soak_load import Record
from pagefleet_lab.bench.soak_watch import ProcSample, ReplicaState, leaked_blocks


@dataclass
class Sample:
    t: float  # seconds since the load started
    finished: int  # requests finished (any outcome) so far
    procs: list[ProcSample]
    replicas: dict[str, ReplicaState]
    fleet_replicas: float | None
    window: dict[str, int] = field(default_factory=dict)
    e2e_p99: float = math.nan
    ttft_p99: float = math.nan
    e2e_p50: float = math.nan
    dt: float = 0.0  # the window's length (a loaded machine wakes the sampler late)

    @property
    def rate(self) -> float:
        return sum(self.window.values()) / self.dt if self.dt > 0 else 0.0

    def role_rss(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for p in self.procs:
            out[p.role] += p.rss_mib
        return dict(out)


@dataclass
class RoleGrowth:
    role: str
    processes: int  # at the last sample
    rss_start: float  # the role's total after the warm-up (MiB)
    rss_end: float
    per_1k: float  # MiB per 1,000 requests, the sum of its processes' slopes
    worst_per_1k: float  # the steepest single process
    churn: int  # processes that started or ended after the warm-up


def rss_growth(samples: Sequence[Sample], warmup_s: float) -> list[RoleGrowth]:
    """Per role, RSS growth per 1,000 finished requests, fitted per process after the warm-up.

    Fitting each process on its own (then summing the role's slopes) keeps a replica that
    the autoscaler adds or removes from reading as growth or shrinkage of the role.
    """
    after = [s for s in samples if s.t >= warmup_s]
    if len(after) < 3:
        after = list(samples)
    if not after:
        return []
    series: dict[int, tuple[str, list[float], list[float]]] = {}
    for s in after:
        for p in s.procs:
            role, xs, ys = series.setdefault(p.pid, (p.role, [], []))
            xs.append(s.finished)
            ys.append(p.rss_mib)
    first_pids = {p.pid for p in after[0].procs}
    last_pids = {p.pid for p in after[-1].procs}
    start, end = after[0].role_rss(), after[-1].role_rss()
    out = []
    for role in sorted({r for r, _, _ in series.values()}):
        slopes = [slope(xs, ys) * 1000 for r, xs, ys in series.values() if r == role]
        slopes = [v for v in slopes if not math.isnan(v)]
        pids = {pid for pid, (r, _, _) in series.items() if r == role}
        out.append(
            RoleGrowth(
                role,
                len(pids & last_pids),
                start.get(role, 0.0),
                end.get(role, 0.0),
                sum(slopes) if slopes else math.nan,
                max(slopes) if slopes else math.nan,
                len(pids - first_pids) + len((pids & first_pids) - last_pids),
            )
        )
    return out


def fifths(records: Sequence[Record], span_s: float) -> tuple[list[Record], list[Record]]:
    """The requests sent in the first and in the last fifth of the load.

    By start, not by end: when the load stops, the long requests still in flight finish
    last, and a fifth chosen by end time would hold more of them than the mix does.
    """
    first = [r for r in records if r.start < span_s / 5]
    last = [r for r in records if r.start >= span_s * 4 / 5]
    return first, last


def window_stats(records: Sequence[Record]) -> tuple[dict[str, int], float, float]:
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        counts[r.outcome] += 1
    ok = [r for r in records if r.outcome == "ok"]
    e2e = percentile([r.end - r.start for r in ok], 0.99)
    ttft = percentile([r.ttft for r in ok if r.ttft is not None], 0.99)
    return dict(counts), e2e, ttft


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    span_s: float = 0.0
    drain_s: float = 0.0
    unfinished: int = 0
    final: dict[str, ReplicaState] = field(default_factory=dict)
    idle: bool = False
    after_ok: bool = False


def _plot(run: Run, out: str, warmup_s: float) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    ts = [s.t / 60 for s in run.samples]
    roles = sorted({p.role for s in run.samples for p in s.procs})
    colors = plt.get_cmap("tab20").colors
    per_role = [s.role_rss() for s in run.samples]
    base_at = next((i for i, s in enumerate(run.samples) if s.t >= warmup_s), 0)
    ax = axes[0][0]
    for i, role in enumerate(roles):
        ax.plot(ts, [r.get(role, math.nan) for r in per_role], label=role, color=colors[i % 20])
    ax.set_title("RSS per process role (MiB, summed over its processes)")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=7, ncol=2)
    # The same, as the change since the warm-up against requests finished: the fit's axes.
    ax = axes[0][1]
    xs = [s.finished for s in run.samples]
    for i, role in enumerate(roles):
        base = per_role[base_at].get(role)
        if base is None:
            continue
        ys = [r.get(role, math.nan) - base for r in per_role]
        ax.plot(xs, ys, label=role, color=colors[i % 20])
    ax.axvline(run.samples[base_at].finished, color="gray", ls=":", lw=1)
    ax.set_title("RSS change since the warm-up (MiB, dotted line) per role")
    ax.set_xlabel("requests finished")
    ax = axes[0][2]
    ax.plot(ts, [s.e2e_p99 for s in run.samples], label="e2e p99")
    ax.plot(ts, [s.e2e_p50 for s in run.samples], label="e2e p50", ls=":")
    ax.plot(ts, [s.ttft_p99 for s in run.samples], label="TTFT p99 (streamed)")
    ax.set_title("latency of the requests finished in each window (s)")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for outcome in ("ok", "cancelled", "disconnected", "rejected", "error"):
        ax.plot(ts, [s.window.get(outcome, 0) / s.dt for s in run.samples], label=outcome)
    ax.set_title("requests/s by outcome")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(ts, [sum(r.total - r.free for r in s.replicas.values()) for s in run.samples])
    ax.set_title("KV blocks in use (all replicas) and engine replicas (red)")
    ax.set_xlabel("minutes")
    ax2 = ax.twinx()
    counts = [s.fleet_replicas or len(s.replicas) for s in run.samples]
    ax2.step(ts, counts, "r--", where="post")
    ax2.set_ylim(0, max([*counts, 1]) + 1)
    ax = axes[1][2]
    ax.plot(ts, [sum(r.values()) / 1024 for r in per_role])
    ax.set_title("RSS of all the server's processes (GiB)")
    ax.set_xlabel("minutes")
    for a in axes.flat:
        a.grid(alpha=0.3)
    save_png(fig, out, 90)


def _f(v: float, fmt: str = ".2f") -> str:
    return "n/a" if math.isnan(v) else format(v, fmt)


def _drift(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or a == 0:
        return "n/a"
    return f"{a:.2f} -> {b:.2f} s ({(b / a - 1) * 100:+.0f} %)"


def summary_rows(run: Run, server: dict[str, object]) -> tuple[list[list[object]], int]:
    """The summary table's rows, and the leaked blocks (-1: no replica reported)."""
    recs = run.records
    counts: dict[str, int] = defaultdict(int)
    for r in recs:
        counts[r.outcome] += 1
    total = len(recs)
    errors = counts["error"] + run.unfinished
    leaked = leaked_blocks(run.final) if run.final else -1
    first, last = fifths(recs, run.span_s)
    _, e2e_a, ttft_a = window_stats(first)
    _, e2e_b, ttft_b = window_stats(last)
    rows: list[list[object]] = [
        ["requests finished", f"{total} ({total / max(run.span_s, 1e-9):.1f}/s)"],
        ["ok", counts["ok"]],
        ["cancelled by the client (mid-stream)", counts["cancelled"]],
        ["disconnected by the client (before a token)", counts["disconnected"]],
        [
            "429 (rejected, counted apart)",
            f"{counts['rejected']} ({counts['rejected'] / max(total, 1) * 100:.3f} %)",
        ],
        ["errors (other than the client's own)", errors],
        ["**error rate** (errors / requests)", f"**{errors / max(total, 1) * 100:.3f} %**"],
        ["unfinished when the load stopped (hung)", run.unfinished],
        [
            "**leaked KV blocks** (total - free, every replica, idle)",
            f"**{leaked}**" if leaked >= 0 else "**unknown (no replica reported)**",
        ],
        [
            "fleet idle after the load",
            f"{'yes' if run.idle else 'NO'} after {run.drain_s:.0f} s "
            f"({len(run.final)} replica(s): "
            + ", ".join(f"{int(r.free)}/{int(r.total)} free" for r in run.final.values())
            + ")",
        ],
        ["**p99 e2e latency drift** (first -> last fifth)", f"**{_drift(e2e_a, e2e_b)}**"],
        ["p99 TTFT drift, streamed (first -> last fifth)", _drift(ttft_a, ttft_b)],
        ["a completion after the soak", "ok" if run.after_ok else "FAILED"],
        [
            "server stopped with SIGINT",
            f"exit code {server['code']}"
            + (f", left running: {server['left']}" if server["left"] else ", nothing left"),
        ],
    ]
    return rows, leaked


def rss_table(run: Run, warmup_s: float) -> str:
    rows = [
        [
            g.role,
            g.processes,
            f"{g.rss_start:.0f}",
            f"{g.rss_end:.0f}",
            _f(g.per_1k),
            _f(g.worst_per_1k),
            g.churn,
        ]
        for g in rss_growth(run.samples, warmup_s)
    ]
    header = [
        "role",
        "processes",
        "RSS after warm-up",
        "RSS at end",
        "growth MiB / 1k req",
        "worst process MiB / 1k req",
        "churn",
    ]
    return markdown_table(header, rows)


def describe_load(run: Run, args: argparse.Namespace) -> str:
    """The paragraph on what the soak sent and how the fleet's replicas moved."""
    counts_seen = [int(s.fleet_replicas or len(s.replicas)) for s in run.samples]
    ids_seen = {r for s in run.samples for r in s.replicas}
    # A replica the autoscaler removed is gone from /metrics: its blocks cannot be read at
    # the end (its drain is what Serve checks), so the report says how many there were.
    gone = sorted(ids_seen - set(run.final))
    after_warmup = [s for s in run.samples if s.t >= args.warmup_s]
    return (
        f"Config `{args.config}` served by `pagefleet serve` in a subprocess; "
        f"{args.users} users for {args.minutes:g} min (seed {args.seed}), each sending one "
        "request after another: 70 % short (8-32 tokens) / 30 % long (128-384), half "
        "completions / half chat (two shared system prompts: prefix-cache hits), 70 % "
        "streamed, 10 % with n=2, ignore_eos (so every answer's token count is checked); "
        f"{args.cancel_rate:.0%} of streams closed midway by the client (and as many "
        "non-streamed requests abandoned 0.3-1.5 s after sending, while being generated), "
        f"{args.disconnect_rate:.0%} of requests abandoned 0.02-0.3 s after sending "
        "(before the first token or while queued); a new request follows at once. "
        "Samples every "
        f"{args.sample_s:g} s; RSS fits start after a {args.warmup_s:g} s warm-up "
        f"({len(after_warmup)} samples). Engine replicas: "
        + (f"{min(counts_seen)}-{max(counts_seen)} over the run" if counts_seen else "none sampled")
        + (
            f"; {len(gone)} replica(s) left during the run (removed by the autoscaler; "
            "their blocks are not read at the end)."
            if gone
            else "."
        )
    )


def report(
    run: Run, args: argparse.Namespace, machine: str, server: dict[str, object]
) -> tuple[Path, int]:
    """Write the report and the plot: (the report's path, leaked blocks, -1 unknown)."""
    summary, leaked = summary_rows(run, server)
    reasons: dict[str, int] = defaultdict(int)
    for r in run.records:
        if r.outcome in ("error", "rejected"):
            reasons[r.reason] += 1
    parts = [
        describe_load(run, args),
        "",
        f"{machine} Load average at the end: {server['load_end']} (a shared machine: other "
        "work competes for the cores).",
        "",
        markdown_table(["", "value"], summary),
        "",
        "RSS per process role (MiB, summed over the role's processes; growth: each "
        "process's linear fit of RSS on finished requests after the warm-up, summed over "
        "the role, per 1,000 requests; churn: processes that started or ended after the "
        "warm-up, e.g. replicas the autoscaler moved):",
        "",
        rss_table(run, args.warmup_s),
    ]
    if reasons:
        by_count = sorted(reasons.items(), key=lambda kv: -kv[1])
        parts += [
            "",
            "Errors and 429s by reason:",
            "",
            markdown_table(["reason", "count"], by_count),
        ]
    _plot(run, args.out, args.warmup_s)
    title = "Soak: mixed load with cancels and disconnects"
    return write_report(args.out, title, "\n".join(parts)), leaked
