"""`bench serve --scenario structured`'s own parts: the schema check, the constrained
twin of a workload, and the summary line that gives the constraint's cost."""

from __future__ import annotations

import json

from pagefleet.bench.client import RequestResult
from pagefleet.bench.serve import (
    CONSTRAINED,
    NUM_VALUES,
    STRUCTURED_FORMAT,
    LevelResult,
    constrained,
    follows_schema,
    structured_summary,
    workload,
)


def test_the_schema_check_is_exact() -> None:
    good = json.dumps({"values": [3] * NUM_VALUES})
    assert follows_schema(good)
    for bad in (
        json.dumps({"values": [3] * (NUM_VALUES - 1)}),
        json.dumps({"values": [10] + [3] * (NUM_VALUES - 1)}),
        json.dumps({"values": [True] + [3] * (NUM_VALUES - 1)}),
        json.dumps({"values": [3] * NUM_VALUES, "x": 1}),
        good[:-1],
        None,
    ):
        assert not follows_schema(bad), bad


def test_the_constrained_workload_is_the_same_requests_with_the_format() -> None:
    work = workload([2], 2, 16)
    twin = constrained(work)
    assert [(n, [[r.prompt for r in u] for u in p]) for n, p in twin.levels] == [
        (n, [[r.prompt for r in u] for u in p]) for n, p in work.levels
    ]
    assert all(
        r.structured_outputs == STRUCTURED_FORMAT for _, p in twin.levels for u in p for r in u
    )
    assert all(r.structured_outputs is None for _, p in work.levels for u in p for r in u)


def test_the_summary_gives_the_cost_and_the_valid_count() -> None:
    def result(tokens: int, ttft: float, text: str | None = None) -> RequestResult:
        return RequestResult(ok=True, ttft=ttft, tokens=tokens, text=text)

    valid = json.dumps({"values": [1] * NUM_VALUES})
    free = LevelResult("pagefleet", 20, [result(50, 0.5), result(50, 0.7)], wall_s=1.0)
    bound = LevelResult(
        "pagefleet" + CONSTRAINED, 20, [result(40, 0.6, valid), result(40, 0.8, "{")], 1.0
    )
    assert structured_summary([free, bound]) == [
        "- pagefleet, 20 users: json_schema / free output tok/s **0.80x** (100.0 -> 80.0); "
        "TTFT p50 0.600 -> 0.700 s; 1/2 answers follow the schema"
    ]
