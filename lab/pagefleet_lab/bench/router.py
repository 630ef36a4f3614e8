"""`pagefleet-lab router`: the routing policies side by side on the same workloads.

For each policy (most_free_blocks, power_of_two, round_robin, and Ray Serve LLM's
PrefixCacheAffinityRouter as prefix_cache_affinity) this command
starts `pagefleet serve` with 2 engine replicas of the same model and the same
small KV pool, runs every scenario against it, and stops it; policies run one
after another in one run, never at the same time (they would share the CPU).

Scenarios (each a pure function of `--seed`: the same requests, in the same
per-user order, for every policy):

(a) skew: skewed lengths under KV pressure. Mostly short requests and a few
    long ones (a long prompt and a longer output, about 40% of one replica's
    blocks each). Two long requests on one replica do not leave room for the
    short ones there: they queue behind them, or preempt them.
(b) prefix: many users sharing a few long system prompts, each followed by the
    user's own question. One replica's pool holds half of the system prompts
    besides its running requests, not all of them, so what it gains from
    prefix caching depends on which requests it is sent.

Load is closed loop: a fixed number of users, each sending its own list of
requests one after another (streamed, ignore_eos, so each makes exactly its
max_tokens), users starting evenly over the first `--ramp-s` seconds. Why
closed loop: the number of requests in flight, hence the KV pressure the
scenarios are about, is then the same on a fast and a slow (or shared)
machine, where a fixed Poisson rate would overload one and idle the other.
Before each scenario's measured requests, `--warmup-per-user` unmeasured ones
per user (drawn the same way; for (b) with the same system prompts), then a
pause until the fleet is idle: the measured requests meet warm prefix caches
and a router that has seen them, as in a fleet that has been serving a while.

Per policy and scenario: output tokens/s (all completion tokens over the wall
time from first send to last answer), client-side TTFT p50/p90/p99,
preemptions and prefix-cache hit rate (deltas of the replicas'
`vllm:num_preemptions` and `vllm:prefix_cache_hits` / `queries`, which count
tokens), and requests per replica (deltas of the router's
`pagefleet:routed_requests`). For most_free_blocks also the prefix hits it
expected (`pagefleet:router_prefix_hit_blocks`), to compare with what the
replicas found. OUT.json beside the report holds the same per policy and scenario
(`router_report.result_row`, each request's TTFT included), for `sim_validation` to
set the simulator's run of the same workloads (`sim_router`) beside.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.client import RequestResult, closed_loop
from pagefleet.bench.launcher import exit_on_signals, pagefleet_serve
from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.metrics import Scrape, counter_delta, wait_idle
from pagefleet.bench.workloads import (
    BenchRequest,
    deal,
    random_tokens,
    shared_prefix_workload,
    skewed_workload,
    token_range,
)
from pagefleet_lab.bench.router_report import (
    POLICIES,
    SCENARIOS,
    Outcome,
    Scenario,
    fmt,
    report,
)


def scenarios(args: argparse.Namespace, vocab_size: int) -> list[Scenario]:
    """The measured requests of each scenario and, before them, `--warmup-per-user`
    requests per user drawn the same way (for prefix: the same system prompts)."""
    out = []
    for name in args.scenarios.split(","):
        if name == "skew":
            warmup_n = args.warmup_per_user * args.skew_users

            def skew(n: int, seed: int) -> list[BenchRequest]:
                return skewed_workload(
                    n,
                    args.long_fraction,
                    (args.long_prompt[0], args.long_prompt[1]),
                    (args.long_output[0], args.long_output[1]),
                    (args.short_prompt[0], args.short_prompt[1]),
                    (args.short_output[0], args.short_output[1]),
                    vocab_size,
                    seed,
                )

            reqs = skew(args.skew_requests, args.seed)
            warmup = skew(warmup_n, args.seed + 7919) if warmup_n else []
            n_long = sum(r.kind == "long" for r in reqs)
            desc = (
                f"{len(reqs)} requests ({n_long} long: prompt {_range(args.long_prompt)}, "
                f"output {_range(args.long_output)} tokens; {len(reqs) - n_long} short: prompt "
                f"{_range(args.short_prompt)}, output {_range(args.short_output)}), "
                f"{args.skew_users} users"
            )
            out.append(Scenario(name, reqs, args.skew_users, desc, warmup))
        elif name == "prefix":
            warmup_n = args.warmup_per_user * args.prefix_users
            # One draw, so that warm-up and measured requests share the system prompts.
            both = shared_prefix_workload(
                warmup_n + args.prefix_requests,
                args.system_prompts,
                args.system_tokens,
                (args.question_tokens[0], args.question_tokens[1]),
                (args.prefix_output[0], args.prefix_output[1]),
                vocab_size,
                args.seed + 1,
            )
            warmup, reqs = both[:warmup_n], both[warmup_n:]
            desc = (
                f"{len(reqs)} requests, {args.prefix_users} users; each: one of "
                f"{args.system_prompts} system prompts of {args.system_tokens} tokens + a "
                f"question of {_range(args.question_tokens)} tokens, output "
                f"{_range(args.prefix_output)} tokens"
            )
            out.append(Scenario(name, reqs, args.prefix_users, desc, warmup))
        else:
            raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    return out


def router_args(argv: Sequence[str] = ()) -> argparse.Namespace:
    """bench router's arguments as its command line parses `argv` (its defaults for the
    rest): what the simulator reads to send the same requests to the same fleet."""
    parser = argparse.ArgumentParser(prog="pagefleet bench")
    add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["router", *argv])


def _range(r: list[int]) -> str:
    return f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"


def fleet_config(args: argparse.Namespace, model: str, policy: str) -> dict:
    return {
        "model": model,
        "served_model_name": Path(model).name,
        "replicas": 2,
        # Two replicas, the ingress and Serve's proxy share this machine's cores; the
        # engines each get one thread so that they do not fight over both.
        "replica_resources": {"num_cpus": 0.5},
        "routing": policy,
        "routing_stats_period_s": args.routing_stats_period_s,
        "engine": {
            "dtype": args.dtype,
            "block_size": args.block_size,
            "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "num_threads": 1,
        },
    }


def fleet_warmup_requests(vocab_size: int, seed: int) -> list[BenchRequest]:
    """`_warm_up`'s requests: each sent at once by a user of its own (the simulator's
    closed loop sends the same ones, `sim_router`)."""
    import random

    rng = random.Random(seed + 1000)
    return [BenchRequest(random_tokens(rng, 64, vocab_size), 8) for _ in range(6)]


def _warm_up(url: str, model: str, vocab_size: int, seed: int) -> None:
    """A few requests of random tokens (no prefix any scenario uses), so that no
    replica's first steps (allocator, kernels) land in a measurement."""
    reqs = fleet_warmup_requests(vocab_size, seed)
    results, _ = asyncio.run(closed_loop(url, model, [[r] for r in reqs], [0.0] * len(reqs)))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def user_offsets(users: int, ramp_s: float) -> list[float]:
    """When each user starts, from the scenario's start: evenly over the ramp."""
    return [ramp_s * u / users for u in range(users)]


def measure(
    url: str, model: str, policy: str, scenario: Scenario, ramp_s: float, block_size: int
) -> Outcome:
    from tqdm import tqdm

    offsets = user_offsets(scenario.users, ramp_s)
    if scenario.warmup:
        # Not measured: the system reaches its steady state (warm prefix caches, the
        # router's view of them) before the measured requests, as in a fleet that has
        # been serving for a while. The same for every policy.
        results, _ = asyncio.run(
            closed_loop(url, model, deal(scenario.warmup, scenario.users), offsets)
        )
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"{scenario.name} warm-up failed: {bad[0]}")
    before = wait_idle(url)
    per_user = deal(scenario.requests, scenario.users)
    errors = 0
    with tqdm(
        total=len(scenario.requests), desc=f"{policy} {scenario.name}", unit="req", mininterval=2.0
    ) as bar:

        def done(res: RequestResult) -> None:
            nonlocal errors
            errors += not res.ok
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors)

        results, wall = asyncio.run(closed_loop(url, model, per_user, offsets, done))
    after = wait_idle(url)
    return outcome(policy, scenario.name, results, wall, before, after, block_size)


def outcome(
    policy: str,
    scenario: str,
    results: list[RequestResult],
    wall_s: float,
    before: Scrape,
    after: Scrape,
    block_size: int,
) -> Outcome:
    def moved(name: str) -> float:
        return after.total(name) - before.total(name)

    routed = counter_delta(before, after, "pagefleet:routed_requests_total", "replica")
    return Outcome(
        policy=policy,
        scenario=scenario,
        results=results,
        wall_s=wall_s,
        preemptions=moved("vllm:num_preemptions_total"),
        prefix_hits=moved("vllm:prefix_cache_hits_total"),
        prefix_queries=moved("vllm:prefix_cache_queries_total"),
        router_hit_tokens=moved("pagefleet:router_prefix_hit_blocks_total") * block_size,
        per_replica=sorted((round(v) for v in routed.values()), reverse=True),
    )


# -- the command ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    model, vocab = ensure_model(args.model, args.preset)
    scens = scenarios(args, vocab)
    notes = [
        machine_description(),
        "",
        f"Fleet: `pagefleet serve`, 2 replicas of `{Path(model).name}` ({args.dtype}), each "
        f"{args.num_kv_blocks} KV blocks of {args.block_size} tokens, max_num_seqs "
        f"{args.max_num_seqs}, one engine thread; routing stats every "
        f"{args.routing_stats_period_s:g} s. One `pagefleet serve` per policy, in turn; per "
        "policy, the scenarios in order. Closed loop: each user sends its requests "
        f"one after another (streamed, ignore_eos), users starting over {args.ramp_s:g} s, "
        f"after {args.warmup_per_user} unmeasured warm-up request(s) per user (drawn the same "
        "way; for (b) with the same system prompts) and a pause until the fleet is idle; "
        f"the same requests (seed {args.seed}) in the same per-user order for every policy. "
        "TTFT is measured by the client; preemptions and prefix hits (tokens) are deltas of "
        "the replicas' vllm: counters, requests per replica of pagefleet:routed_requests. "
        "`router expected`: the prompt tokens most_free_blocks counted as cached on the "
        "replica it chose (pagefleet:router_prefix_hit_blocks x block size) over the same "
        "queries; above the hit rate when the replicas' digests (polled every stats period) "
        "list blocks they have evicted since.",
    ]
    print(notes[0], flush=True)
    outcomes: list[Outcome] = []
    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-router-"))
    t_start = time.monotonic()
    try:
        with LoadMonitor() as load:
            for policy in policies:
                print(
                    f"[{time.monotonic() - t_start:6.0f} s] starting 2 replicas, routing {policy}",
                    flush=True,
                )
                with pagefleet_serve(
                    fleet_config(args, model, policy), workdir, policy, replicas=2
                ) as fleet:
                    _warm_up(fleet.url, fleet.model, vocab, args.seed)
                    for s in scens:
                        o = measure(fleet.url, fleet.model, policy, s, args.ramp_s, args.block_size)
                        print(
                            f"[{time.monotonic() - t_start:6.0f} s] {policy} {s.name}: "
                            f"{len(o.ok)}/{len(o.results)} ok, {o.tok_s:.1f} tok/s, TTFT p50 "
                            f"{o.ttft(0.5):.3f} s p99 {o.ttft(0.99):.3f} s, {o.preemptions:.0f} "
                            f"preemptions, prefix hits {fmt(o.hit_rate, '.1%')}, per replica "
                            f"{o.per_replica}",
                            flush=True,
                        )
                        outcomes.append(o)
        notes.insert(1, load.summary())
        path = report(outcomes, scens, args, notes)
        print(path.read_text())
        print(f"took {time.monotonic() - t_start:.0f} s")
        failed = sum(len(o.results) - len(o.ok) for o in outcomes)
        return 1 if failed else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router",
        help="routing policies side by side on 2 replicas: skewed lengths, shared prefixes",
        description=__doc__.split("\n\n")[0]
        + " Starts `pagefleet serve` once per policy. LO-HI: a uniform range of tokens.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="models/smollm-135m", help="checkpoint directory")
    p.add_argument(
        "--preset",
        default="smollm-135m",
        choices=["tiny", "smollm-135m"],
        help="shape to write at --model if it is missing (`pagefleet make-model`)",
    )
    p.add_argument("--dtype", default="float32", help="weights and KV cache")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list, in run order")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list, in run order")
    p.add_argument("--seed", type=int, default=0, help="workload seed (same for every policy)")
    p.add_argument("--ramp-s", type=float, default=2.0, help="users start evenly over this")
    p.add_argument(
        "--warmup-per-user",
        type=int,
        default=2,
        help="unmeasured requests per user before each scenario's measured ones",
    )
    g = p.add_argument_group("fleet: 2 replicas, each")
    g.add_argument("--num-kv-blocks", type=int, default=128, help="KV pool (small: pressure)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=64, help="batch size cap")
    g.add_argument("--max-model-len", type=int, default=1024, help="context length")
    g.add_argument(
        "--routing-stats-period-s",
        type=float,
        default=2.0,
        help="how often Serve polls replica stats (the config's default)",
    )
    g = p.add_argument_group("(a) skew: a few long requests among many short ones")
    g.add_argument("--skew-users", type=int, default=12, help="concurrent users")
    g.add_argument("--skew-requests", type=int, default=192, help="requests in all")
    g.add_argument("--long-fraction", type=float, default=0.0625, help="share of long requests")
    g.add_argument("--long-prompt", type=token_range, default="640-768", help="LO-HI")
    g.add_argument("--long-output", type=token_range, default="96-160", help="LO-HI")
    g.add_argument("--short-prompt", type=token_range, default="16-96", help="LO-HI")
    g.add_argument("--short-output", type=token_range, default="16-64", help="LO-HI")
    g = p.add_argument_group("(b) prefix: users sharing a few long system prompts")
    g.add_argument("--prefix-users", type=int, default=12, help="concurrent users")
    g.add_argument("--prefix-requests", type=int, default=144, help="requests in all")
    g.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts")
    g.add_argument(
        "--system-tokens",
        type=int,
        default=576,
        help="tokens per system prompt (576 = 36 blocks: a replica's 128 hold 2 of the 4 and "
        "its running requests, not all 4)",
    )
    g.add_argument("--question-tokens", type=token_range, default="16-48", help="LO-HI")
    g.add_argument("--prefix-output", type=token_range, default="16-48", help="LO-HI")
    p.add_argument(
        "--out",
        default="benchmarks/results/router",
        help="writes OUT.md, OUT.png and OUT.json (per policy and scenario, machine-readable)",
    )
