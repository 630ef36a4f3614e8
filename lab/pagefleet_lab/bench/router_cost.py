"""`pagefleet-lab router-cost`: what one routing decision costs the ingress, in CPU.

The real policy (`pagefleet/cluster/routing/`), no Ray and no engine: for each replica
count in `--replicas`, `--in-flight` requests the replicas' reports do not include yet
(sent since them, as at 100 requests/s with reports 2.5 s stale), each a prompt of
`--prompt-tokens` tokens hashed by the engine's own prefix hashing
(`pagefleet.engine.block_hashes`: 128 blocks of 16 for 2k tokens). Half of each prompt is
one of `--system-prompts` shared system prompts, each cached on one replica (a real
`PrefixDigest` in that replica's report, parsed as the router parses it); the rest is
the request's own.

Each decision does what the Serve adapter does per request: reconcile the reports
(`RouterState.reconcile`), rank the replicas (`choose_replica`) and reserve on the first
choice (`RouterState.on_routed`). The reports move on by one send per decision, so the
router always holds exactly `--in-flight` pending requests and their prompts. The
first `--in-flight` decisions fill the state, untimed; the next `--decisions` are
timed one by one (`time.perf_counter_ns`): the median and p99 of the whole step and of
`choose_replica` alone.

To compare two revisions, run the command in a checkout of each on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Sequence
from types import SimpleNamespace

from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.bench.workloads import random_tokens
from pagefleet.cluster.routing import config, policy, reports, state
from pagefleet.engine import PrefixDigest, block_hashes, prefix_hash_salt

VOCAB = 32_000
# The policy's names `measure` reads, one namespace: the product's routing package.
ROUTING = SimpleNamespace(
    **{k: getattr(reports, k) for k in dir(reports) if k.startswith("STAT_")},
    RoutingConfig=config.RoutingConfig,
    ReplicaLoad=reports.ReplicaLoad,
    RouterState=state.RouterState,
    RouteRequest=policy.RouteRequest,
    choose_replica=policy.choose_replica,
)
SEND_INTERVAL_S = 0.01  # 100 requests/s


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests as the router sees them: prompt block hashes under `salt`."""

    block_size: int
    salt: int
    prompt_tokens: int
    max_tokens: int
    prompts: tuple[tuple[int, ...], ...]  # each request's block hashes, in send order
    systems: tuple[tuple[int, ...], ...]  # each system prompt's block hashes

    @classmethod
    def make(
        cls,
        requests: int,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        system_prompts: int,
        seed: int,
    ) -> Workload:
        rng = random.Random(seed)
        salt = prefix_hash_salt("bench/router-cost", block_size)
        head = prompt_tokens // 2
        systems = [random_tokens(rng, head, VOCAB) for _ in range(system_prompts)]
        prompts = tuple(
            tuple(
                block_hashes(
                    rng.choice(systems) + random_tokens(rng, prompt_tokens - head, VOCAB),
                    block_size,
                    salt,
                )
            )
            for _ in range(requests)
        )
        system_hashes = tuple(tuple(block_hashes(s, block_size, salt)) for s in systems)
        return cls(block_size, salt, prompt_tokens, max_tokens, prompts, system_hashes)


@dataclasses.dataclass(frozen=True)
class Timing:
    replicas: int
    step_ns: list[int]  # reconcile + choose_replica + on_routed
    choose_ns: list[int]  # choose_replica alone
    choices: list[str]  # every decision's replica, fill included

    def us(self, which: str, q: float) -> float:
        return percentile(getattr(self, f"{which}_ns"), q) / 1000


def measure(
    policy: SimpleNamespace,
    work: Workload,
    replicas: int,
    in_flight: int,
    decisions: int,
    seed: int,
) -> Timing:
    """Time `decisions` router steps of `policy` over `replicas` after `in_flight` untimed
    ones (module docstring). The workload needs `in_flight + decisions` prompts."""
    if len(work.prompts) < in_flight + decisions:
        raise ValueError("the workload has too few prompts")
    config = policy.RoutingConfig()
    bs, need = work.block_size, -(-(work.prompt_tokens + work.max_tokens) // work.block_size)
    total = max(64, 4 * in_flight * need // replicas)
    reports = []
    for r in range(replicas):
        digest = PrefixDigest(PrefixDigest.bits_for(total))
        for system in work.systems[r::replicas]:
            for h in system:
                digest.add(h)
        stats = {
            policy.STAT_FREE_BLOCKS: total // 2,
            policy.STAT_TOTAL_BLOCKS: total,
            policy.STAT_BLOCK_SIZE: bs,
            policy.STAT_RUNNING: 0,
            policy.STAT_WAITING: 0,
            policy.STAT_PREFIX_DIGEST: digest.to_bytes(),
            policy.STAT_HASH_SALT: work.salt,
            policy.STAT_TIMESTAMP: 0.0,
        }
        reports.append(policy.ReplicaLoad.from_routing_stats(f"r{r}", stats))
    state = policy.RouterState(memory_blocks=config.affinity_memory_blocks)
    rng = random.Random(seed)
    step_ns: list[int] = []
    choose_ns: list[int] = []
    choices: list[str] = []
    clock = time.perf_counter_ns
    for i in range(in_flight + decisions):
        now = 1000.0 + i * SEND_INTERVAL_S
        # Reports taken just late enough to include every send but the last `in_flight`.
        seen = 1000.0 + (i - in_flight - 1) * SEND_INTERVAL_S + config.stats_include_slack_s
        loads = [dataclasses.replace(ld, timestamp=seen) for ld in reports]
        request = policy.RouteRequest(
            f"q{i}", work.prompt_tokens, work.max_tokens, work.prompts[i], work.salt
        )
        t0 = clock()
        state.reconcile(loads, config, now)
        t1 = clock()
        d = policy.choose_replica(request, loads, state, config, rng, now)
        t2 = clock()
        first = d.replica_id
        state.on_routed(
            request.request_id,
            first,
            d.cost_blocks[first],
            now,
            request.prompt_block_hashes,
            d.owner,
        )
        t3 = clock()
        choices.append(first)
        if i >= in_flight:
            step_ns.append(t3 - t0)
            choose_ns.append(t2 - t1)
    return Timing(replicas, step_ns, choose_ns, choices)


HEADER = (
    "replicas",
    "in flight",
    "prompt blocks",
    "code",
    "decision p50 (µs)",
    "decision p99 (µs)",
    "choose_replica p50 (µs)",
    "choose_replica p99 (µs)",
)


def table_rows(
    runs: Sequence[tuple[str, Timing]], in_flight: int, blocks: int
) -> list[list[object]]:
    return [
        [
            t.replicas,
            in_flight,
            blocks,
            code,
            f"{t.us('step', 0.5):.0f}",
            f"{t.us('step', 0.99):.0f}",
            f"{t.us('choose', 0.5):.0f}",
            f"{t.us('choose', 0.99):.0f}",
        ]
        for code, t in runs
    ]


def hashing_us(work: Workload, seed: int, samples: int = 50) -> float:
    """Median µs to hash one prompt (`block_hashes`), which every decision adds on top."""
    rng = random.Random(seed)
    times = []
    for _ in range(samples):
        tokens = random_tokens(rng, work.prompt_tokens, VOCAB)
        t0 = time.perf_counter_ns()
        block_hashes(tokens, work.block_size, work.salt)
        times.append(time.perf_counter_ns() - t0)
    return percentile(times, 0.5) / 1000


def run(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.replicas.split(",")]
    work = Workload.make(
        args.in_flight + args.decisions,
        args.prompt_tokens,
        args.max_tokens,
        args.block_size,
        args.system_prompts,
        args.seed,
    )
    codes: list[tuple[str, SimpleNamespace]] = [("this checkout", ROUTING)]
    runs: list[tuple[str, Timing]] = []
    same = True
    with LoadMonitor() as load:
        for n in counts:
            timed = [
                (code, measure(p, work, n, args.in_flight, args.decisions, args.seed))
                for code, p in codes
            ]
            same &= all(t.choices == timed[0][1].choices for _, t in timed)
            runs += timed
            for code, t in timed:
                print(f"{n} replicas, {code}: decision p50 {t.us('step', 0.5):.0f} µs", flush=True)
    blocks = len(work.prompts[0])
    body = "\n".join(
        [
            machine_description(),
            load.summary(),
            "",
            f"The routing policy alone (no Ray): {args.in_flight} requests in flight that no "
            f"report includes yet, prompts of {args.prompt_tokens} tokens ({blocks} blocks of "
            f"{args.block_size}; half of each one of {args.system_prompts} system prompts, "
            f"each cached on one replica), max_tokens {args.max_tokens}. A decision: "
            "reconcile the reports, choose_replica, reserve on the first choice; "
            f"{args.decisions} timed decisions per row after {args.in_flight} untimed ones. "
            f"Hashing the prompt (`block_hashes`, the same in every row) adds "
            f"{hashing_us(work, args.seed):.0f} µs per request on top.",
            ""
            if len(codes) == 1
            else "\nSame replica chosen for every decision by both codes: "
            + ("yes." if same else "**no**."),
            "",
            markdown_table(HEADER, table_rows(runs, args.in_flight, blocks)),
        ]
    )
    print(body)
    _plot(runs, args.out)
    path = write_report(args.out, "Router cost per decision", body)
    print(f"\nwrote {path}")
    return 0 if same else 1


def _plot(runs: Sequence[tuple[str, Timing]], out: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for code in dict.fromkeys(c for c, _ in runs):
        mine = [t for c, t in runs if c == code]
        xs = [t.replicas for t in mine]
        (line,) = ax.plot(xs, [t.us("step", 0.5) for t in mine], "o-", label=f"{code} p50")
        ax.plot(
            xs,
            [t.us("step", 0.99) for t in mine],
            "o--",
            color=line.get_color(),
            label=f"{code} p99",
        )
    ax.set_xscale("log", base=2)
    counts = sorted({t.replicas for _, t in runs})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("µs per decision")
    ax.legend(fontsize=8)
    save_png(fig, out, 110)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router-cost",
        help="µs per routing decision (the policy alone) at 2, 16 and 64 replicas",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--replicas", default="2,16,64", help="comma list of replica counts")
    p.add_argument("--in-flight", type=int, default=256, help="requests no report includes")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--system-prompts", type=int, default=8, help="shared prompt halves")
    p.add_argument("--decisions", type=int, default=2000, help="timed decisions per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/router_cost")
