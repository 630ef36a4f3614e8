"""`-m gpu` runs these; any other run leaves them out (skipped), GPU or not."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "gpu" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="a GPU check: run with `-m gpu` (benchmarks/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
