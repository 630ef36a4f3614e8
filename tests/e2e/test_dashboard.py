"""The dashboard in a real browser (headless Chromium, tests/e2e/browser.py).

A `pagefleet serve` fleet of two replicas under streaming load: every chart of
`/dashboard` gets data points, the replica count shown is the server's, and once
the server is stopped the page says it cannot reach it. With an API key (the
in-process app: `pagefleet serve` learns the key in its own change), the page
asks for the key once, rejects a wrong one, and shows the data with the right one.
Screenshots go to test-artifacts/ (git-ignored).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.test_dashboard import KEY, complete, in_process_server, port_in_range
from tests.e2e.browser import (
    CHARTS,
    Load,
    chart_points,
    chart_series,
    chromium,
    screenshot,
    served_replicas,
    wait_for_points,
)
from tests.e2e.served import Served, serving, stop_served

ENGINE = {
    "num_kv_blocks": 160,
    "block_size": 8,
    "max_num_seqs": 16,
    "max_model_len": 256,
    "num_threads": 1,
}
MAX_TOKENS = 24

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def fleet(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "port": port_in_range(),
        "replicas": 2,
        "replica_resources": {"num_cpus": 0.5},
        "routing_stats_period_s": 0.5,
        "engine": ENGINE,
    }
    with serving(config, tmp_path_factory.mktemp("dashboard")) as served:
        yield served


@pytest.fixture(scope="module")
def fleet_page(browser: Any, fleet: Served) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    yield page
    page.close()


def metric_replicas(url: str, name: str) -> set[str]:
    text = httpx.get(f"{url}/metrics").text
    return {
        s.labels["replica"]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


@pytest.mark.e2e
def test_every_chart_fills_under_load(fleet: Served, fleet_page: Any) -> None:
    load = Load(fleet.url, users=6, max_tokens=MAX_TOKENS)
    try:
        fleet_page.goto(f"{fleet.url}/dashboard")
        assert list(chart_points(fleet_page)) == list(CHARTS)
        wait_for_points(fleet_page, list(CHARTS), timeout_s=90)
    finally:
        tokens = load.stop()
    assert tokens and set(tokens) == {MAX_TOKENS}  # every request of the load was served
    # What the page shows is the server's state.
    assert fleet_page.get_attribute("#status", "data-state") == "ok"
    assert served_replicas(fleet.url) == 2
    assert fleet_page.get_attribute("#replicas", "data-value") == "2"
    engine_replicas = metric_replicas(fleet.url, "pagefleet:kv_blocks_total")
    for chart in ("kv-cache", "running", "waiting"):
        assert chart_series(fleet_page, chart) == sorted(engine_replicas), chart
    routed = chart_series(fleet_page, "routed")
    assert routed and set(routed) <= metric_replicas(fleet.url, "pagefleet:routed_requests_total")
    # A fixed fleet: the target is the configured count (pagefleet:target_replicas).
    text = httpx.get(f"{fleet.url}/metrics").text
    (target,) = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pagefleet:target_replicas"
    ]
    assert target == 2.0
    assert fleet_page.inner_text("#target-replicas") == "2"
    assert chart_series(fleet_page, "replicas") == ["replicas", "target"]
    points = chart_points(fleet_page)
    assert all(points[c] > 0 for c in CHARTS), points
    screenshot(fleet_page, "dashboard-fleet.png")


@pytest.mark.e2e
def test_the_page_says_when_the_server_is_gone(fleet: Served, fleet_page: Any) -> None:
    before = chart_points(fleet_page)
    stop_served(fleet)
    fleet_page.wait_for_selector('#status[data-state="unreachable"]', timeout=20_000)
    status = fleet_page.inner_text("#status")
    assert status.startswith(f"Cannot reach the pagefleet server at {fleet.url} (since ")
    # A poll answered while the server was stopping may have added a point; after the
    # first failed poll the last data stay on screen through the retries (every 2 s).
    last = chart_points(fleet_page)
    assert all(last[c] >= before[c] for c in CHARTS), (before, last)
    fleet_page.wait_for_timeout(4_500)
    assert fleet_page.get_attribute("#status", "data-state") == "unreachable"
    assert chart_points(fleet_page) == last
    screenshot(fleet_page, "dashboard-unreachable.png")


def test_the_page_asks_for_the_api_key_once(llama_dir: str, browser: Any) -> None:
    with in_process_server(llama_dir, api_key=KEY) as h:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(f"{h.url}/dashboard")
        page.wait_for_selector('#status[data-state="auth"]', timeout=15_000)
        assert page.is_visible("#key-form")
        assert page.inner_text("#key-message") == ""

        page.fill("#api-key", "not-the-key")
        page.click("#key-form button")
        page.wait_for_selector("#key-message:has-text('rejected')", timeout=15_000)
        assert page.is_visible("#key-form")

        page.fill("#api-key", KEY)
        page.click("#key-form button")
        page.wait_for_selector('#status[data-state="ok"]', timeout=15_000)
        assert not page.is_visible("#key-form")
        complete(h.url, 3, 8)
        # No router in the in-process app: every chart but routed requests gets data.
        wait_for_points(page, [c for c in CHARTS if c != "routed"], timeout_s=30)
        assert chart_points(page)["routed"] == 0
        assert page.get_attribute("#replicas", "data-value") == "1" == str(served_replicas(h.url))
        assert page.evaluate("sessionStorage.getItem('pagefleet.apiKey')") == KEY

        page.reload()  # asked once: the key is kept for the tab
        page.wait_for_selector('#status[data-state="ok"]', timeout=15_000)
        assert not page.is_visible("#key-form")
        wait_for_points(page, ["output-tokens", "kv-cache"], timeout_s=15)
        assert dialogs == []
        shot: Path = screenshot(page, "dashboard-api-key.png")
        assert shot.stat().st_size > 0
        page.close()
