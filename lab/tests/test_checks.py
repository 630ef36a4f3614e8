"""The pytest runner behind the lab's GPU check and vLLM parity results."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pagefleet_lab.bench.checks import run_checks


def test_run_checks_reads_back_outcomes_and_recorded_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "test_inner_checks.py").write_text(
        textwrap.dedent(
            """
            import os
            import pytest

            pytestmark = pytest.mark.inner

            def test_good(record_property):
                record_property("row", ["a", os.environ["INNER_VALUE"]])

            def test_bad(record_property):
                record_property("row", ["b", "-"])
                assert 1 == 2, "one is not two"

            def test_skipped():
                pytest.skip("nothing to see")
            """
        )
    )
    monkeypatch.setenv("INNER_VALUE", "old")  # restored afterwards
    code, results = run_checks(str(tmp_path), "inner", {"INNER_VALUE": "42"})
    assert code == 1
    got = {r.name: r for r in results}
    assert got["test_good"].verdict == "ok" and got["test_good"].properties["row"] == ["a", "42"]
    assert got["test_bad"].verdict == "FAIL" and "one is not two" in got["test_bad"].message
    assert got["test_skipped"].verdict == "skipped" and got["test_skipped"].message == (
        "nothing to see"
    )
