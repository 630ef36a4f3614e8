"""`pagefleet bench fairness`'s plan and fleet (the run itself needs a served fleet)."""

from __future__ import annotations

import argparse

from pagefleet.bench.fairness import add_parser, arrivals, config_for
from pagefleet.cluster.config import ServeConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["fairness", *argv])


def test_the_streams_are_seeded_poisson_at_their_rates() -> None:
    prompts = [(i, i + 1) for i in range(5)]
    plan = arrivals(2.0, 10.0, 200.0, prompts, seed=3)
    assert plan == arrivals(2.0, 10.0, 200.0, prompts, seed=3)
    assert [a.at for a in plan] == sorted(a.at for a in plan)
    counts = {s: sum(a.stream == s for a in plan) for s in ("light", "heavy", "urgent")}
    # 400 light and urgent, 4,000 heavy expected: within 10 %.
    assert 360 <= counts["light"] <= 440 and 360 <= counts["urgent"] <= 440
    assert 3600 <= counts["heavy"] <= 4400
    assert [a.prompt for a in plan[:6]] == prompts + prompts[:1]


def test_the_fleet_is_fixed_with_priority_and_fairness_on_or_off() -> None:
    args = parse("--replicas", "2", "--max-num-seqs", "4")
    for fair in (False, True):
        config = ServeConfig.model_validate(config_for(args, fair))
        assert (config.replicas, config.autoscaling) == (2, None)
        assert config.engine.max_num_seqs == 4
        assert config.engine.scheduling_policy == "priority"
        assert config.fairness.enabled is fair
        assert config.fairness.tenant_header == "x-tenant"
        assert config.model.endswith("models/smollm-135m")
