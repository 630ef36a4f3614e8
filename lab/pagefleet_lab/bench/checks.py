"""Running a marked pytest selection for a results writer, and reading back what each
test recorded: the correctness checks are tests (`tests/gpu`, `tests/vllm`), and the
writers of benchmarks/results/gpu.md and vllm_parity.md format their outcomes.

A test records its report row with `record_property("row", [...])` (and may add
`record_property("result", "...")` for a verdict other than ok / FAIL).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


@dataclass
class CheckResult:
    nodeid: str
    outcome: str  # "passed", "failed" or "skipped"
    message: str = ""  # why it failed or was skipped, in short
    properties: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The test's name with its parameters: what comes after the last `::`."""
        return self.nodeid.rsplit("::", 1)[-1]

    @property
    def verdict(self) -> str:
        if self.outcome == "passed":
            return str(self.properties.get("result", "ok"))
        return "FAIL" if self.outcome == "failed" else "skipped"


class _Collector:
    """A pytest plugin: one CheckResult per test (and per module skipped or broken whole)."""

    def __init__(self) -> None:
        self.results: dict[str, CheckResult] = {}

    def pytest_collectreport(self, report: Any) -> None:
        if report.outcome != "passed":
            self.results[report.nodeid] = CheckResult(
                report.nodeid, report.outcome, _message(report)
            )

    def pytest_runtest_logreport(self, report: Any) -> None:
        # Setup, call, teardown in turn: the call's outcome, unless a setup skipped or
        # failed, or a teardown failed; the first failure stays.
        if report.when != "call" and report.passed:
            return
        earlier = self.results.get(report.nodeid)
        if earlier is not None and earlier.outcome == "failed":
            return
        self.results[report.nodeid] = CheckResult(
            report.nodeid, report.outcome, _message(report), dict(report.user_properties)
        )


def _message(report: Any) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    text = str(report.longrepr or "")
    lines = [line for line in text.splitlines() if line.startswith("E ")]
    return (" ".join(line[1:].strip() for line in lines[:3]) or text[-300:]).strip()[:300]


def run_checks(
    tests: str, marker: str, env: dict[str, str], extra: list[str] | None = None
) -> tuple[int, list[CheckResult]]:
    """`pytest -m MARKER REPO/TESTS` (TESTS: relative to the repository, or absolute) in
    this process, with `env` set first: (pytest's exit code, each test's result in run
    order)."""
    import pytest

    path = REPO / tests
    if not path.is_dir():
        raise SystemExit(f"{path}: the checks are the repository's tests; run from a checkout")
    os.environ.update(env)
    collector = _Collector()
    args = [str(path), "-m", marker, "-p", "no:cacheprovider", "-q", *(extra or [])]
    code = pytest.main(args, plugins=[collector])
    return int(code), list(collector.results.values())
