"""Reading a fleet's `/metrics`: one page parsed once, counters compared, idleness."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Scrape:
    """One /metrics page: (sample name, labels) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def by(self, name: str, label: str) -> dict[str, float]:
        """Summed per value of `label` (series without it under "")."""
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def value(self, name: str) -> float | None:
        values = [v for (n, _), v in self.samples.items() if n == name]
        return values[0] if values else None

    def replicas(self) -> list[str]:
        """The engine replicas that report their KV blocks."""
        return [r for r in self.by("pagefleet:kv_blocks_total", "replica") if r]


def parse_metrics(text: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    out = Scrape()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> Scrape:
    r = httpx.get(f"{url}/metrics", timeout=timeout, headers=headers)
    # While the app deploys, Serve's proxy answers 404 with a text body: an HTTPError
    # (callers waiting for readiness retry on it), never a page to parse.
    r.raise_for_status()
    return parse_metrics(r.text)


async def scrape_async(client: httpx.AsyncClient, url: str, timeout: float = 10.0) -> Scrape:
    """`scrape` on the caller's async client (its headers: a fleet's API key)."""
    r = await client.get(f"{url}/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def counter_delta(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    """How far a counter moved per label value (series new in `after` count from 0)."""
    b, a = before.by(name, label), after.by(name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}


def wait_idle(url: str, timeout: float = 300.0, settle_s: float = 1.5) -> Scrape:
    """Until no replica runs or queues anything, then `settle_s` more (replicas push
    their series to the metrics hub about twice a second): the scrape then counts
    everything the last requests did."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m.total("vllm:num_requests_running") == 0 and m.total("vllm:num_requests_waiting") == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: still busy after {timeout:.0f} s")
        time.sleep(0.5)
    time.sleep(settle_s)
    return scrape(url)
