"""The dashboard in a real browser (headless Chromium, tests/e2e/browser.py) behind an
API key (the in-process app): the page asks for the key once, rejects a wrong one, and
shows the data with the right one. Screenshots go to test-artifacts/ (git-ignored).

Its charts over a real `pagefleet serve` fleet under load, and the page once that
server is gone, are tested on test_fleet.py's fleet (one server for both).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_dashboard import KEY, complete, in_process_server
from tests.e2e.browser import (
    CHARTS,
    chart_points,
    chromium,
    screenshot,
    served_replicas,
    wait_for_points,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


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
        assert (
            page.get_attribute("#replicas", "data-value") == "1" == str(served_replicas(h.url, KEY))
        )
        assert page.evaluate("sessionStorage.getItem('pagefleet.apiKey')") == KEY

        page.reload()  # asked once: the key is kept for the tab
        page.wait_for_selector('#status[data-state="ok"]', timeout=15_000)
        assert not page.is_visible("#key-form")
        wait_for_points(page, ["output-tokens", "kv-cache"], timeout_s=15)
        assert dialogs == []
        shot: Path = screenshot(page, "dashboard-api-key.png")
        assert shot.stat().st_size > 0
        page.close()
