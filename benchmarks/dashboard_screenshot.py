"""Screenshot of `/dashboard` under load: benchmarks/results/dashboard.png (in the README).

    pagefleet serve configs/local.yaml &       # or a copy on another port
    .venv/bin/python benchmarks/dashboard_screenshot.py --url http://127.0.0.1:8000

`--users` clients (default 8) each stream completions one after another
(max_tokens 64, ignore_eos) for `--duration` seconds (default 60); the
screenshot is taken at the end, while they are still running. The browser is
Debian's chromium, headless (tests/e2e/browser.py says why these flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.browser import CHARTS, CHROMIUM, CHROMIUM_ARGS  # noqa: E402


async def user(client: httpx.AsyncClient, url: str, u: int, until: float, max_tokens: int) -> int:
    body = {
        "model": "tiny",
        "prompt": f"# user {u}\ndef fibonacci(n):",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
    }
    done = 0
    while time.monotonic() < until:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
        done += 1
    return done


async def load(url: str, users: int, duration_s: float, max_tokens: int) -> int:
    until = time.monotonic() + duration_s
    async with httpx.AsyncClient(timeout=120) as client:
        counts = await asyncio.gather(
            *(user(client, url, u, until, max_tokens) for u in range(users))
        )
    return sum(counts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/dashboard.png"))
    args = p.parse_args()

    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{args.url}/dashboard")
        # The load runs in a thread of its own; the page keeps polling meanwhile.
        result: list[int] = []
        t = threading.Thread(
            target=lambda: result.append(
                asyncio.run(load(args.url, args.users, args.duration, args.max_tokens))
            )
        )
        t.start()
        page.wait_for_timeout((args.duration - 3) * 1000)
        points = page.eval_on_selector_all(
            "section.chart", "els => els.map(e => [e.id, Number(e.dataset.points)])"
        )
        page.screenshot(path=args.out, full_page=True)
        t.join()
        browser.close()
    print(f"{result[0]} requests by {args.users} users in {args.duration:.0f} s; wrote {args.out}")
    print("points per chart:", dict(points))
    missing = [c for c in CHARTS if dict(points).get(f"chart-{c}", 0) == 0]
    if missing:
        print(f"charts without data: {missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
