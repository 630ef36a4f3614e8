"""Headless Chromium for the dashboard's tests, and a bounded streaming load to show on it.

The browser is Debian's `chromium` (`.ci/run` installs it), driven through
Playwright's Python API with `executable_path`: Playwright's own browser
download is never used. Without /usr/bin/chromium the tests skip, unless
PAGEFLEET_REQUIRE_BROWSER is set (as `.ci/run` does), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # root in a container: Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# The page's charts (section ids chart-NAME in pagefleet/cluster/static/dashboard.js).
CHARTS = (
    "output-tokens",
    "requests",
    "ttft",
    "itl",
    "kv-cache",
    "running",
    "waiting",
    "replicas",
    "routed",
)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (playwright Browser), closed afterwards."""
    if not os.path.exists(CHROMIUM):
        msg = f"{CHROMIUM} is missing (`apt-get install chromium`; .ci/run does it)"
        if os.environ.get("PAGEFLEET_REQUIRE_BROWSER"):
            pytest.fail(msg)
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def chart_points(page: Any) -> dict[str, int]:
    """{chart: values plotted} as the page's DOM says (data-points of each chart)."""
    return page.eval_on_selector_all(
        "section.chart",
        "els => Object.fromEntries(els.map(e => [e.id.slice(6), Number(e.dataset.points)]))",
    )


def chart_series(page: Any, chart: str) -> list[str]:
    value = page.get_attribute(f"#chart-{chart}", "data-series")
    return value.split(",") if value else []


def wait_for_points(page: Any, charts: list[str], timeout_s: float) -> None:
    page.wait_for_function(
        "ids => ids.every(id => Number(document.getElementById('chart-' + id).dataset.points) > 0)",
        arg=charts,
        timeout=timeout_s * 1000,
    )


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def served_replicas(url: str, api_key: str | None = None) -> int:
    """The server's replica count from /metrics, as the dashboard defines it (`api_key`:
    a server with a key protects /metrics by default)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    if "pagefleet:replicas" in fams:
        return round(max(s.value for s in fams["pagefleet:replicas"].samples))
    return len({s.labels["replica"] for s in fams["pagefleet:kv_blocks_total"].samples})


class Load:
    """`users` threads, each streaming completions one after another until stopped.

    Bounded: a user stops by itself after `limit_s`. `stop()` returns the tokens of
    every finished request, so a test can check that all of them were served.
    """

    def __init__(
        self,
        url: str,
        users: int,
        max_tokens: int,
        headers: dict[str, str] | None = None,
        limit_s: float = 180.0,
    ) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.headers = headers or {}
        self.deadline = time.monotonic() + limit_s
        self.done = threading.Event()
        self.tokens: list[int] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._user, args=(u,), daemon=True) for u in range(users)
        ]
        for t in self._threads:
            t.start()

    def _user(self, u: int) -> None:
        body = {
            "model": "tiny",
            "prompt": f"user {u}: def f(x):",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(timeout=120, headers=self.headers) as client:
            while not self.done.is_set() and time.monotonic() < self.deadline:
                try:
                    tokens = self._one(client, body)
                except httpx.HTTPError as e:
                    tokens, err = None, f"{type(e).__name__}: {e}"
                else:
                    err = None
                with self._lock:
                    if tokens is not None:
                        self.tokens.append(tokens)
                    else:
                        self.errors.append(err or "no usage")

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> int | None:
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise httpx.HTTPStatusError(r.text, request=r.request, response=r)
            usage = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
            return None if usage is None else usage["completion_tokens"]

    def stop(self) -> list[int]:
        self.done.set()
        for t in self._threads:
            t.join(150)
        assert not any(t.is_alive() for t in self._threads)
        assert self.errors == []
        return self.tokens
