"""The fleet benchmarks' pure helpers: workloads, the ramp, metric deltas, the timeline,
bench serve's requests and scenarios."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagefleet.bench import add_bench_parser, serve
from pagefleet.bench.metrics import counter_delta, parse_metrics
from pagefleet.bench.workloads import (
    FIRST_PLAIN_TOKEN,
    BenchRequest,
    deal,
    distinct_prompts,
    shared_prefix_workload,
    skewed_workload,
    token_range,
)


def skew(seed: int = 0) -> list:
    return skewed_workload(100, 0.1, (600, 700), (100, 150), (10, 20), (5, 8), 1024, seed)


def test_skewed_workload_is_seeded_and_has_the_asked_mix() -> None:
    a, b = skew(), skew()
    assert a == b  # every policy gets exactly these requests
    assert skew(1) != a
    longs = [r for r in a if r.kind == "long"]
    shorts = [r for r in a if r.kind == "short"]
    assert len(longs) == 10 and len(shorts) == 90
    assert all(600 <= len(r.prompt) <= 700 and 100 <= r.max_tokens <= 150 for r in longs)
    assert all(10 <= len(r.prompt) <= 20 and 5 <= r.max_tokens <= 8 for r in shorts)
    assert all(FIRST_PLAIN_TOKEN <= t < 1024 for r in a for t in r.prompt)
    # Random prompts: no two requests share a first block of 16 tokens.
    assert len({r.prompt[:16] for r in longs}) == 10


def test_shared_prefix_workload_shares_exactly_the_system_prompts() -> None:
    reqs = shared_prefix_workload(200, 4, 256, (16, 32), (8, 8), 1024, 3)
    assert reqs == shared_prefix_workload(200, 4, 256, (16, 32), (8, 8), 1024, 3)
    systems = {r.prompt[:256] for r in reqs}
    assert len(systems) == 4
    assert {r.kind for r in reqs} == {"system0", "system1", "system2", "system3"}
    by_kind = {r.kind: r.prompt[:256] for r in reqs}
    assert all(r.prompt[:256] == by_kind[r.kind] for r in reqs)
    assert all(16 <= len(r.prompt) - 256 <= 32 and r.max_tokens == 8 for r in reqs)
    assert [sum(r.kind == k for r in reqs) for k in sorted(by_kind)] == [50] * 4
    assert [r.kind for r in reqs[:8]] != ["system0", "system1", "system2", "system3"] * 2


def test_token_range_reads_lo_hi_or_one_number() -> None:
    assert token_range("640-768") == [640, 768]
    assert token_range("32") == [32, 32]


def test_deal_keeps_every_request_once_in_order() -> None:
    reqs = skew()
    per_user = deal(reqs, 7)
    assert len(per_user) == 7
    assert sorted(id(r) for u in per_user for r in u) == sorted(id(r) for r in reqs)
    assert per_user[2][:2] == [reqs[2], reqs[9]]
    with pytest.raises(ValueError):
        deal(reqs, 0)


def test_counter_delta_counts_new_series_from_zero() -> None:
    before = parse_metrics(
        "# TYPE pagefleet:routed_requests counter\n"
        'pagefleet:routed_requests_total{policy="p",replica="a"} 3.0\n'
    )
    after = parse_metrics(
        "# TYPE pagefleet:routed_requests counter\n"
        'pagefleet:routed_requests_total{policy="p",replica="a"} 10.0\n'
        'pagefleet:routed_requests_total{policy="p",replica="b"} 4.0\n'
    )
    assert counter_delta(before, after, "pagefleet:routed_requests_total", "replica") == {
        "a": 7.0,
        "b": 4.0,
    }
    assert after.total("pagefleet:routed_requests_total") == 14.0


# -- bench serve's requests and scenarios ---------------------------------------------


def test_distinct_prompts_are_exact_seeded_and_share_no_first_block() -> None:
    prompts = distinct_prompts(50, 32, 1024, seed=7, exclude=(20, 21))
    assert prompts == distinct_prompts(50, 32, 1024, seed=7, exclude=(20, 21))
    assert prompts != distinct_prompts(50, 32, 1024, seed=8, exclude=(20, 21))
    assert all(len(p) == 32 for p in prompts)
    assert len({p[0] for p in prompts}) == 50  # a first token each: no shared block
    assert all(FIRST_PLAIN_TOKEN <= t < 1024 and t not in (20, 21) for p in prompts for t in p)
    assert [len(p) for p in distinct_prompts(3, 1, 1024, 0)] == [1, 1, 1]
    with pytest.raises(ValueError, match="distinct first tokens"):
        distinct_prompts(10, 4, FIRST_PLAIN_TOKEN + 9, 0)
    with pytest.raises(ValueError):
        distinct_prompts(1, 0, 1024, 0)


def test_serve_workload_gives_every_request_its_own_prompt_of_n_tokens() -> None:
    work = serve.workload([1, 3], 2, 16, logprobs=2, prompt_tokens=40, vocab_size=1024)
    assert work == serve.workload([1, 3], 2, 16, logprobs=2, prompt_tokens=40, vocab_size=1024)
    assert [len(u) for u in work.warm] == [1] * serve.WARM_USERS
    assert [(users, [len(u) for u in reqs]) for users, reqs in work.levels] == [
        (1, [2]),
        (3, [2, 2, 2]),
    ]
    every = [r for reqs in [work.warm] + [r for _, r in work.levels] for u in reqs for r in u]
    assert len(every) == serve.WARM_USERS + 2 + 6
    assert all(len(r.prompt) == 40 and r.logprobs == 2 for r in every)
    assert len({r.prompt[:16] for r in every}) == len(every)  # warm-up and levels alike
    assert {r.max_tokens for u in work.warm for r in u} == {serve.WARM_TOKENS}
    assert {r.max_tokens for _, reqs in work.levels for u in reqs for r in u} == {16}
    # Without --prompt-tokens: the short texts, user u's k-th request PROMPTS[(u + k) % 10].
    text = serve.workload([3], 2, 50)
    assert text.levels[0][1][2][1] == BenchRequest(serve.PROMPTS[3], 50)
    assert serve.rounds(text.levels[0][1])[1][0] == {
        "prompt": serve.PROMPTS[1],
        "max_tokens": 50,
        "logprobs": None,
    }


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser)
    args = parser.parse_args(["serve", *argv])
    serve.apply_scenario(args)
    return args


def test_long_prompt_scenario_is_16_users_of_one_1200_token_prompt() -> None:
    args = _serve_args("--scenario", "long-prompt")
    assert (args.concurrency, args.requests_per_user, args.max_tokens) == ("16", 1, 64)
    assert (args.prompt_tokens, args.max_model_len, args.threads) == (1200, 2048, 1)
    assert not args.offline_ratio and args.logprobs is None
    assert args.out == "benchmarks/results/serve_long_prompt"
    short = _serve_args()
    assert (short.scenario, short.concurrency, short.requests_per_user) == (
        "short",
        "1,5,10,20,50",
        2,
    )
    assert (short.max_tokens, short.prompt_tokens, short.max_model_len) == (50, None, None)
    assert short.out == "benchmarks/results/serve"
    mine = _serve_args("--scenario", "long-prompt", "--concurrency", "2", "--threads", "2")
    assert (mine.concurrency, mine.prompt_tokens, mine.threads) == ("2", 1200, 2)


def test_served_configs_get_the_threads_and_the_max_model_len(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {model}\nengine: {{max_model_len: 512, num_threads: 1}}\n")
    args = _serve_args("--config", str(cfg), "--scenario", "long-prompt", "--threads", "2")
    args.sweep = "max_num_seqs=8,16"
    configs, model_dir, _ = serve._configs(args)
    assert model_dir == str(model) and args.max_model_len == 2048
    assert [c["engine"]["max_num_seqs"] for _, c in configs] == [8, 16]
    assert all(c["engine"]["num_threads"] == 2 for _, c in configs)
    assert all(c["engine"]["max_model_len"] == 2048 for _, c in configs)
    short = _serve_args("--config", str(cfg))
    serve._configs(short)
    assert short.max_model_len == 512  # the config's
