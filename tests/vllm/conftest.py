"""`-m vllm` runs these; any other run leaves them out (skipped), vLLM or not."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "vllm" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(
        reason="a vLLM parity check: run with `-m vllm` and PAGEFLEET_VLLM_PYTHON set"
    )
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
