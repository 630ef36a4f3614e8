"""`pagefleet bench serve`: the seed article's load test, for any OpenAI-compatible URL.

At each concurrency level, that many users each send `--requests-per-user`
streaming completions one after another (ignore_eos, so every request makes exactly
max_tokens tokens). Per level and server: success rate, output tokens/s over the
level's wall time, TTFT and inter-token latency p50/p99, end-to-end latency p50/p99.
Servers are measured one after another in one run (side by side), never at the same
time: they share the CPU.

Scenarios (`--scenario`; a flag given on the command line overrides its value):
"short" (the seed article's: 10 short texts, 50 tokens out, 1-50 users),
"long-prompt" (16 users x one 1,200-token prompt x 64 tokens out, max_model_len
2048) and "structured" (20 users x 2 requests, each server measured twice: free text
of 64 tokens, then the same prompts constrained to a JSON schema whose every valid
answer has the same shape, `STRUCTURED_SCHEMA`, sent as vLLM's `structured_outputs`; every constrained answer is
checked against it, and the report gives constrained / free throughput per server). `--prompt-tokens N` sends distinct random prompts of exactly N token ids (no
two share a prefix block), `--logprobs K` asks for K logprobs on every request.

Servers: `--url` (any number, e.g. a running `vllm serve`), `--config` (a
pagefleet config this command serves itself on a free port, once per
`--sweep` value), and `--vllm-python` (a venv with vLLM's CPU build; this
command starts `vllm.entrypoints.openai.api_server` on the same checkpoint, at
its defaults: no enforce_eager). Both run with `--threads` compute threads and the
same max_model_len. `--offline-ratio` also runs each of them offline (its engine's
`LLM.generate`, in a child process) on each level's requests, for the ratio
served tok/s / offline tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagefleet.bench.client import TEMPERATURE, RequestResult, closed_loop, model_id
from pagefleet.bench.launcher import (
    exit_on_signals,
    free_port,
    launch,
    pagefleet_serve,
    served_config,
)
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.bench.vllm_child import (
    api_server_command,
    describe_vllm_threads,
    run_child,
    vllm_env,
    vllm_thread_env,
)
from pagefleet.bench.workloads import BenchRequest, distinct_prompts

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "def quicksort(items):",
    "The three most important ideas in distributed systems are",
    "Translate to French: the weather is nice today.",
    "List five uses for a paperclip:",
    "import numpy as np\n\n# compute the moving average",
    "Once upon a time in a small village,",
    "Summarize the plot of a detective novel.",
    "class LRUCache:\n    def __init__(self, capacity):",
]
DEFAULT_MAX_MODEL_LEN = 512  # without a scenario's, the flag's or the config's
WARM_USERS, WARM_TOKENS = 2, 8  # the warm-up before the first level
VLLM_NAME = "vllm serve (CPU build)"


@dataclass(frozen=True)
class Scenario:
    """What `--scenario` sets, flag by flag (a flag given on the command line wins)."""

    concurrency: str
    requests_per_user: int
    max_tokens: int
    prompt_tokens: int | None  # None: the 10 short texts
    max_model_len: int | None  # None: the config's (DEFAULT_MAX_MODEL_LEN without)


SCENARIOS = {
    "short": Scenario("1,5,10,20,50", 2, 50, None, None),
    "long-prompt": Scenario("16", 1, 64, 1200, 2048),
    "structured": Scenario("20", 2, 64, None, None),
}
# Every valid answer is {"values": [24 digits]}: about as many tokens as the free
# requests make, whatever the model, so the two runs compare like with like.
NUM_VALUES = 24
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": NUM_VALUES,
            "maxItems": NUM_VALUES,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}
# vLLM's grammars let whitespace run free between JSON tokens unless told not to, and a
# random model spends its whole budget there (every one of vLLM's answers was cut short
# at 64 tokens); pagefleet's JSON is always compact. Asked the same, both servers write
# the same text. vLLM takes that option only in its `structured_outputs` object (beside
# a response_format it refuses it), so the schema goes there, for both.
STRUCTURED_FORMAT = {"json": STRUCTURED_SCHEMA, "disable_any_whitespace": True}
CONSTRAINED = ", json_schema"  # the constrained run's suffix on a server's name


def follows_schema(text: str | None) -> bool:
    """Whether an answer is valid for STRUCTURED_SCHEMA (checked by hand: the bench
    runs without the test extras)."""
    try:
        value = json.loads(text or "")
    except ValueError:
        return False
    values = value.get("values") if isinstance(value, dict) else None
    return (
        isinstance(value, dict)
        and set(value) == {"values"}
        and isinstance(values, list)
        and len(values) == NUM_VALUES
        and all(type(v) is int and 0 <= v <= 9 for v in values)
    )


def constrained(work: Workload) -> Workload:
    """The same requests, each with STRUCTURED_FORMAT."""

    def with_format(per_user: PerUser) -> PerUser:
        return [
            [dataclasses.replace(r, structured_outputs=STRUCTURED_FORMAT) for r in u]
            for u in per_user
        ]

    return Workload(with_format(work.warm), [(n, with_format(p)) for n, p in work.levels])


def apply_scenario(args: argparse.Namespace) -> None:
    """Fill each of `args.scenario`'s settings that the command line left unset, and
    `--out`: benchmarks/results/serve, serve_long_prompt, ... by scenario."""
    scenario = SCENARIOS[args.scenario]
    for f in dataclasses.fields(scenario):
        if getattr(args, f.name, None) is None:
            setattr(args, f.name, getattr(scenario, f.name))
    if args.out is None:
        suffix = "" if args.scenario == "short" else "_" + args.scenario.replace("-", "_")
        args.out = f"benchmarks/results/serve{suffix}"


# -- the requests ----------------------------------------------------------------------

PerUser = list[list[BenchRequest]]  # user u's requests, in sending order


@dataclass
class Workload:
    warm: PerUser
    levels: list[tuple[int, PerUser]]  # (users, their requests) per concurrency level


def workload(
    levels: list[int],
    per_user: int,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_tokens: int | None = None,
    vocab_size: int = 0,
    special_ids: tuple[int, ...] = (),
    seed: int = 0,
) -> Workload:
    """The warm-up (WARM_USERS users x one request of WARM_TOKENS tokens) and every
    level's requests; every server of a run gets exactly these. Without
    `prompt_tokens`, user u's k-th request is the short text PROMPTS[(u + k) % 10].
    With it, every request of the run (the warm-up's too) has a random prompt of
    exactly that many token ids (`distinct_prompts`, seeded): no two share a first
    block, so no level hits the prefix cache another one filled."""
    shape = [(WARM_USERS, 1, WARM_TOKENS)] + [(u, per_user, max_tokens) for u in levels]
    pool = None
    if prompt_tokens is not None:
        count = sum(users * k for users, k, _ in shape)
        pool = iter(distinct_prompts(count, prompt_tokens, vocab_size, seed, special_ids))

    def requests(users: int, k: int, new: int) -> PerUser:
        return [
            [
                BenchRequest(
                    next(pool) if pool else PROMPTS[(u + j) % len(PROMPTS)],
                    new,
                    logprobs=logprobs,
                )
                for j in range(k)
            ]
            for u in range(users)
        ]

    warm, *rest = (requests(*s) for s in shape)
    return Workload(warm, list(zip(levels, rest, strict=True)))


def vocabulary(model_dir: str) -> tuple[int, tuple[int, ...]]:
    """The checkpoint's tokenizer: (its size, its special token ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return len(tokenizer), tuple(tokenizer.all_special_ids)


# -- served ----------------------------------------------------------------------------


@dataclass
class LevelResult:
    server: str
    users: int
    results: list[RequestResult]
    wall_s: float
    offline_tok_s: float | None = None  # its engine offline on the same requests

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def tok_s(self) -> float:
        return sum(r.tokens for r in self.ok) / self.wall_s


def _level(url: str, model: str, reqs: PerUser) -> tuple[list[RequestResult], float]:
    """Each user sending its streamed completions back to back."""
    return asyncio.run(closed_loop(url, model, reqs, [0.0] * len(reqs), timeout_s=600.0))


def measure_all(name: str, url: str, work: Workload, args: argparse.Namespace) -> list[LevelResult]:
    """The levels on one server; with the structured scenario, then constrained too."""
    got = measure(name, url, work)
    if args.scenario == "structured":
        got += measure(name + CONSTRAINED, url, constrained(work))
    return got


def measure(name: str, url: str, work: Workload) -> list[LevelResult]:
    model = model_id(url)
    _level(url, model, work.warm)
    out = []
    for users, reqs in work.levels:
        results, wall = _level(url, model, reqs)
        lr = LevelResult(name, users, results, wall)
        print(
            f"  {name:>28} {users:>3} users: {lr.tok_s:7.1f} tok/s, "
            f"{len(lr.ok)}/{len(results)} ok, TTFT p50 {percentile([r.ttft for r in lr.ok], 0.5):.3f} s",
            flush=True,
        )
        out.append(lr)
    return out


# -- offline: the same requests through the server's own engine -------------------------

# Standalone, run by pagefleet's python (ENGINE pagefleet.engine) or vLLM's (vllm): both
# have vLLM's `LLM` shape. Each level's requests go in rounds, round k being every
# user's k-th request: what the closed loop keeps in flight when all requests are
# alike. Timed after a warm-up, like the served levels.
_OFFLINE_CHILD = textwrap.dedent(
    """
    import importlib, json, sys, time

    def main(engine, spec_path, out_path):
        mod = importlib.import_module(engine)
        spec = json.load(open(spec_path))
        llm = mod.LLM(model=spec["model"], **spec["llm"])

        def generate(batch):
            prompts = [r["prompt"] if isinstance(r["prompt"], str)
                       else {"prompt_token_ids": r["prompt"]} for r in batch]
            params = [mod.SamplingParams(temperature=spec["temperature"],
                                         max_tokens=r["max_tokens"], ignore_eos=True,
                                         logprobs=r["logprobs"]) for r in batch]
            res = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in res)

        for batch in spec["warm"]:
            generate(batch)
        out = []
        for rounds in spec["levels"]:
            start = time.perf_counter()
            tokens = sum(generate(batch) for batch in rounds)
            out.append({"tokens": tokens, "seconds": time.perf_counter() - start})
        version = getattr(mod, "__version__", "")
        json.dump({"version": version, "levels": out}, open(out_path, "w"))

    if __name__ == "__main__":
        main(*sys.argv[1:4])
    """
)


def _as_json(r: BenchRequest) -> dict[str, Any]:
    prompt = r.prompt if isinstance(r.prompt, str) else list(r.prompt)
    return {"prompt": prompt, "max_tokens": r.max_tokens, "logprobs": r.logprobs}


def rounds(reqs: PerUser) -> list[list[dict[str, Any]]]:
    """Round k: every user's k-th request (JSON for the offline child)."""
    depth = max((len(u) for u in reqs), default=0)
    return [[_as_json(u[k]) for u in reqs if k < len(u)] for k in range(depth)]


def offline(
    python: str,
    engine: str,
    model: str,
    llm_args: dict[str, Any],
    env: dict[str, str],
    work: Workload,
) -> tuple[str, list[float]]:
    """`engine`'s LLM(model, **llm_args) in `python` on `work`: (its version, tok/s per
    level)."""
    spec = {
        "model": str(Path(model).resolve()),  # the child runs in a directory of its own
        "llm": llm_args,
        "temperature": TEMPERATURE,
        "warm": rounds(work.warm),
        "levels": [rounds(reqs) for _, reqs in work.levels],
    }
    got = run_child(python, _OFFLINE_CHILD, spec, engine, env=env)
    return got["version"], [r["tokens"] / r["seconds"] for r in got["levels"]]


def _with_offline(levels: list[LevelResult], tok_s: list[float]) -> list[LevelResult]:
    for lr, t in zip(levels, tok_s, strict=True):
        lr.offline_tok_s = t
        print(f"  {lr.server:>28} {lr.users:>3} users: {t:7.1f} tok/s offline", flush=True)
    return levels


# -- report ----------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def is_vllm(server: str) -> bool:
    return "vllm" in server.lower()


def variant(server: str) -> str:
    """ "" for a server's free-text run, CONSTRAINED for its constrained one."""
    return CONSTRAINED if server.endswith(CONSTRAINED) else ""


def _plot(all_levels: list[LevelResult], out: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for server in dict.fromkeys(lr.server for lr in all_levels):
        rows = [lr for lr in all_levels if lr.server == server]
        users = [lr.users for lr in rows]
        (line,) = axes[0].plot(users, [lr.tok_s for lr in rows], marker="o", label=server)
        if any(lr.offline_tok_s for lr in rows):
            axes[0].plot(
                users,
                [lr.offline_tok_s or float("nan") for lr in rows],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{server}: its engine offline",
            )
        axes[1].plot(
            users,
            [percentile([r.ttft for r in lr.ok], 0.5) for lr in rows],
            marker="o",
            label=server,
        )
        axes[2].plot(
            users,
            [percentile([g for r in lr.ok for g in r.gaps], 0.5) * 1000 for lr in rows],
            marker="o",
            label=server,
        )
    for ax, title in zip(
        axes, ["output tokens/s", "TTFT p50 (s)", "inter-token latency p50 (ms)"], strict=True
    ):
        ax.set_xlabel("concurrent users")
        ax.set_title(title)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_png(fig, out, 110)


def settings_lines(args: argparse.Namespace) -> list[str]:
    """What every server of the run was given: the load, the threads, vLLM's mode."""
    prompts = (
        f"distinct random prompts of exactly {args.prompt_tokens} token ids (seeded; no "
        "two share a first token, so none shares a prefix block)"
        if args.prompt_tokens
        else "10 short texts"
    )
    logprobs = f", logprobs {args.logprobs}" if args.logprobs is not None else ""
    eos = (
        "ignore_eos on the free requests (a constrained one ends where its grammar does)"
        if args.scenario == "structured"
        else "ignore_eos"
    )
    lines = [
        f"Scenario `{args.scenario}`: {args.requests_per_user} streaming request(s) per "
        f"user, max_tokens {args.max_tokens}, {eos}, temperature {TEMPERATURE}"
        f"{logprobs}; prompts: {prompts}. max_model_len {args.max_model_len} on every "
        "server this command starts. Servers run one after another in this run.",
        f"Compute threads: **{args.threads}**: pagefleet's engine `num_threads: {args.threads}`.",
    ]
    if args.vllm_python:
        lines[-1] = (
            f"Compute threads: **{args.threads}** on each side: pagefleet's engine "
            f"`num_threads: {args.threads}`; vLLM "
            f"{describe_vllm_threads(vllm_thread_env(args.threads))}."
        )
        version = getattr(args, "vllm_version", "") or "?"
        lines.append(
            f"vLLM mode: the CPU build {version} at its defaults (no enforce_eager), "
            "VLLM_CPU_KVCACHE_SPACE=2 GiB."
        )
    if args.offline_ratio:
        lines.append(
            "Offline: each server's own engine (`LLM.generate`: pagefleet's on the served "
            "config's engine settings, vLLM's `LLM(dtype, max_model_len)`) on each level's "
            "requests in rounds of one request per user, after a warm-up; served / "
            "offline = the server's output tok/s over that."
        )
    if args.url:
        lines.append("Servers given by `--url` run as they were started.")
    return lines


def report(all_levels: list[LevelResult], args: argparse.Namespace, notes: list[str]) -> Path:
    servers = list(dict.fromkeys(lr.server for lr in all_levels))
    by = {(lr.server, lr.users): lr for lr in all_levels}
    vllm = next((s for s in servers if is_vllm(s)), None)
    peers = {variant(s): s for s in servers if is_vllm(s)}  # vLLM's run of each variant
    with_offline = any(lr.offline_tok_s for lr in all_levels)
    header = ["server", "users", "success", "output tok/s"]
    header += ["offline tok/s", "served / offline"] if with_offline else []
    header += ["/ vLLM tok/s"] if vllm else []
    header += [
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
        "e2e p50 (s)",
        "e2e p99 (s)",
    ]
    rows = []
    for lr in all_levels:
        ok = lr.ok
        ttft = [r.ttft for r in ok]
        gaps = [g for r in ok for g in r.gaps]
        e2e = [r.e2e for r in ok]
        row: list[object] = [lr.server, lr.users, f"{len(ok)}/{len(lr.results)}", f"{lr.tok_s:.1f}"]
        if with_offline:
            off = lr.offline_tok_s
            row += [f"{off:.1f}" if off else "-", _ratio(lr.tok_s, off)]
        if vllm:
            theirs = by.get((peers.get(variant(lr.server), ""), lr.users))
            row.append("-" if is_vllm(lr.server) or not theirs else _ratio(lr.tok_s, theirs.tok_s))
        row += [
            f"{percentile(ttft, 0.5):.3f}",
            f"{percentile(ttft, 0.99):.3f}",
            f"{percentile(gaps, 0.5) * 1000:.1f}",
            f"{percentile(gaps, 0.99) * 1000:.1f}",
            f"{percentile(e2e, 0.5):.2f}",
            f"{percentile(e2e, 0.99):.2f}",
        ]
        rows.append(row)
    settings = "\n".join(f"- {line}" for line in settings_lines(args) + notes)
    parts = [settings, markdown_table(header, rows), "\n".join(summary(all_levels))]
    body = "\n\n".join(p for p in parts if p)
    _plot(all_levels, args.out)
    return write_report(args.out, "Serving load test (OpenAI streaming completions)", body)


def _per_level(ratios: list[tuple[int, str]]) -> str:
    return ", ".join(f"**{r}** at {users} users" for users, r in ratios)


def summary(all_levels: list[LevelResult]) -> list[str]:
    """The headline lines: scaling per server, each server over vLLM's, served over
    offline, per level."""
    servers = list(dict.fromkeys(lr.server for lr in all_levels))
    of = {s: [lr for lr in all_levels if lr.server == s] for s in servers}
    out = []
    for s, rows in of.items():
        lo, hi = rows[0], rows[-1]
        if len(rows) > 1 and lo.tok_s > 0:
            out.append(
                f"- {s}: {lo.users} -> {hi.users} users throughput factor "
                f"**{hi.tok_s / lo.tok_s:.1f}x** ({lo.tok_s:.1f} -> {hi.tok_s:.1f} tok/s)"
            )
    by = {(lr.server, lr.users): lr for lr in all_levels}
    for v in (s for s in servers if is_vllm(s)):
        for s in (s for s in servers if not is_vllm(s) and variant(s) == variant(v)):
            got = [
                (lr.users, _ratio(lr.tok_s, by[(v, lr.users)].tok_s))
                for lr in of[s]
                if (v, lr.users) in by
            ]
            if got:
                out.append(f"- output tok/s {s} / {v}: {_per_level(got)}")
    for s, rows in of.items():
        got = [(lr.users, _ratio(lr.tok_s, lr.offline_tok_s)) for lr in rows if lr.offline_tok_s]
        if got:
            out.append(f"- served / offline, {s}: {_per_level(got)}")
    out += structured_summary(all_levels)
    return out


def structured_summary(all_levels: list[LevelResult]) -> list[str]:
    """Per server with a constrained run: what the constraint costs (constrained / free
    output tok/s, TTFT p50 both ways), and how many constrained answers follow the
    schema."""
    by = {(lr.server, lr.users): lr for lr in all_levels}
    out = []
    for lr in all_levels:
        free = by.get((lr.server.removesuffix(CONSTRAINED), lr.users))
        if variant(lr.server) != CONSTRAINED or free is None:
            continue
        answers = [r for r in lr.results if r.text is not None]
        valid = sum(follows_schema(r.text) for r in answers)
        ttft = percentile([r.ttft for r in lr.ok], 0.5)
        free_ttft = percentile([r.ttft for r in free.ok], 0.5)
        out.append(
            f"- {free.server}, {lr.users} users: json_schema / free output tok/s "
            f"**{_ratio(lr.tok_s, free.tok_s)}** ({free.tok_s:.1f} -> {lr.tok_s:.1f}); TTFT "
            f"p50 {free_ttft:.3f} -> {ttft:.3f} s; {valid}/{len(lr.results)} answers follow "
            "the schema"
        )
    return out


# -- the servers -----------------------------------------------------------------------


def _configs(args: argparse.Namespace) -> tuple[list[tuple[str, dict]], str | None, str]:
    """(name, config) per `--sweep` value of `--config` (or the config alone), each
    with `--threads` and the run's max_model_len, its checkpoint, and the report's note
    on it. Sets args.max_model_len where no scenario or flag did: the config's."""
    if not args.config:
        args.max_model_len = args.max_model_len or DEFAULT_MAX_MODEL_LEN
        return [], None, ""
    config, base = served_config(args.config)
    if not Path(config.model).is_dir() and config.make_model:
        from pagefleet.cluster.make_model import make_model

        make_model(config.model, preset=config.make_model)
    args.max_model_len = args.max_model_len or config.engine.max_model_len or DEFAULT_MAX_MODEL_LEN
    engine = {**base["engine"], "num_threads": args.threads, "max_model_len": args.max_model_len}
    base = {**base, "engine": engine}
    configs = [("pagefleet", base)]
    if args.sweep:
        key, _, values = args.sweep.partition("=")
        configs = [
            (f"pagefleet {key}={v}", {**base, "engine": {**engine, key: int(v)}})
            for v in values.split(",")
        ]
    note = (
        f"pagefleet config: `{args.config}` ({config.engine.dtype}, "
        f"{config.replicas} replica(s), max_num_seqs {config.engine.max_num_seqs})"
    )
    return configs, config.model, note


def _measure_pagefleet(
    args: argparse.Namespace, configs: list[tuple[str, dict]], workdir: Path, work: Workload
) -> list[LevelResult]:
    out: list[LevelResult] = []
    for tag, (name, cfg) in enumerate(configs):
        print(f"starting {name} ...", flush=True)
        with pagefleet_serve(cfg, workdir, f"pagefleet-{tag}", timeout_s=300) as server:
            got = measure_all(name, server.url, work, args)
        if args.offline_ratio:
            print(f"{name}: its engine offline (LLM.generate) ...", flush=True)
            _, tok_s = offline(
                sys.executable,
                "pagefleet.engine",
                cfg["model"],
                cfg["engine"],
                {**os.environ},
                work,
            )
            _with_offline(got, tok_s)
        out += got
    return out


def _version(url: str) -> str:
    """vLLM's API server's version (GET /version), or "" if it will not say."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return str(httpx.get(f"{url}/version", timeout=10).json()["version"])
    return ""


def _measure_vllm(
    args: argparse.Namespace, model: str, workdir: Path, work: Workload
) -> tuple[list[LevelResult], str]:
    """vLLM's API server (its CPU build, `--vllm-python`) on `model`: (levels, note)."""
    port = free_port()
    cmd = api_server_command(args.vllm_python, model, port, args.vllm_dtype, args.max_model_len)
    env = vllm_env(args.threads)
    print("starting vllm serve (vLLM's CPU build) ...", flush=True)
    url = f"http://127.0.0.1:{port}"
    with launch(cmd, url, workdir / "vllm.log", env, 600) as server:
        args.vllm_version = _version(server.url)
        got = measure_all(VLLM_NAME, server.url, work, args)
    if args.offline_ratio:
        print("vLLM: its engine offline (LLM.generate) ...", flush=True)
        llm_args = {"dtype": args.vllm_dtype, "max_model_len": args.max_model_len, "seed": 0}
        version, tok_s = offline(args.vllm_python, "vllm", model, llm_args, env, work)
        args.vllm_version = args.vllm_version or version
        _with_offline(got, tok_s)
    note = (
        f"vLLM: `{args.vllm_python} -m vllm.entrypoints.openai.api_server --model "
        f"{model} --max-model-len {args.max_model_len} --dtype {args.vllm_dtype}`"
    )
    return got, note


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
    apply_scenario(args)
    if args.scenario == "structured" and args.offline_ratio:
        raise SystemExit("--offline-ratio does not apply to the structured scenario")
    levels = [int(x) for x in args.concurrency.split(",")]
    names = args.name or []
    configs, model_dir, note = _configs(args)
    notes = [note] if note else []
    vllm_model = args.vllm_model or model_dir
    vocab: tuple[int, tuple[int, ...]] = (0, ())
    if args.prompt_tokens is not None:
        if not vllm_model:
            raise SystemExit("--prompt-tokens needs the tokenizer: give --config or --vllm-model")
        vocab = vocabulary(vllm_model)
    work = workload(
        levels, args.requests_per_user, args.max_tokens, args.logprobs, args.prompt_tokens, *vocab
    )
    all_levels: list[LevelResult] = []
    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-serve-"))
    try:
        for i, url in enumerate(args.url or []):
            name = names[i] if i < len(names) else url
            print(f"measuring {name} at {url}", flush=True)
            all_levels += measure_all(name, url.rstrip("/"), work, args)
        all_levels += _measure_pagefleet(args, configs, workdir, work)
        if args.vllm_python:
            if vllm_model is None:
                raise SystemExit("--vllm-python needs --vllm-model or --config")
            got, note = _measure_vllm(args, vllm_model, workdir, work)
            all_levels += got
            notes.append(note)
        if not all_levels:
            raise SystemExit("nothing to measure: give --url, --config or --vllm-python")
        path = report(all_levels, args, notes)
        print(path.read_text())
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load test of OpenAI-compatible servers (seed article)")
    p.add_argument("--url", action="append", help="a running server (repeatable)")
    p.add_argument("--name", action="append", help="a label per --url, in order")
    p.add_argument("--config", help="serve this pagefleet config and measure it")
    p.add_argument(
        "--sweep", help="KEY=V1,V2: rerun --config per engine setting, e.g. max_num_seqs=8,256"
    )
    p.add_argument(
        "--vllm-python", help="python of a venv with vLLM's CPU build: start and measure it"
    )
    p.add_argument("--vllm-model", help="checkpoint for vLLM (default: the --config model)")
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="short",
        help="short: 10 short texts, 2 requests per user of 50 tokens, 1-50 users; "
        "long-prompt: 16 users x one 1,200-token prompt x 64 tokens, max_model_len 2048; "
        "structured: 20 users, free text then a JSON schema, on each server "
        "(flags below override)",
    )
    p.add_argument("--concurrency", help="comma list of user counts (short: 1,5,10,20,50)")
    p.add_argument("--requests-per-user", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="distinct random prompts of exactly N token ids (no shared prefix) instead of "
        "the short texts",
    )
    p.add_argument("--logprobs", type=int, help="ask for K logprobs on every request")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="of every server started here (default: the scenario's, else the config's, "
        f"else {DEFAULT_MAX_MODEL_LEN})",
    )
    p.add_argument(
        "--threads",
        type=int,
        choices=(1, 2),
        default=1,
        help="compute threads of each server started here: pagefleet's engine num_threads, "
        "vLLM's VLLM_CPU_OMP_THREADS_BIND (1: vLLM's default on 2 cores)",
    )
    p.add_argument(
        "--offline-ratio",
        action="store_true",
        help="also run each started server's engine offline (LLM.generate) on the same "
        "requests: served tok/s / offline tok/s",
    )
    p.add_argument(
        "--out", help="OUT.md and OUT.png (default: benchmarks/results/serve[_SCENARIO])"
    )
