"""The Grafana dashboard queries only series the server exports, and shows what the issue asks."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from pagefleet.cluster import metrics

from .conftest import CHART

DASHBOARD = CHART / "dashboards" / "pagefleet.json"

# PromQL words that are not metric names (aggregations' modifiers, set operators).
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    Strings, label matchers `{...}`, range/offset brackets `[...]` and `by (...)` groupings
    are removed first; what is left that is an identifier, not a function call (followed by
    `(`), not a keyword and not a number is a metric name.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    # Not preceded by a digit or a dot: `5m` in `offset 5m` and `1e3` are no names.
    for match in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        rest = text[match.end() :].lstrip()
        if word in _KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def exported_name(series: str) -> str:
    """The name `metrics.EXPORTED` lists: exposition suffixes stripped."""
    for suffix in _SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def test_metric_name_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(vllm:ttft_bucket{model_name=~"a|b"}[5m])))'
        " / on (x) group_left sum without (replica) (up offset 5m)"
    )
    assert metric_names(expr) == {"vllm:ttft_bucket", "up"}
    assert metric_names("label_values(vllm:num_requests_running, model_name)") == {
        "vllm:num_requests_running",
        "model_name",  # label_values' label argument: checked apart below
    }


def test_every_queried_metric_is_exported(dashboard: dict[str, Any]) -> None:
    exported = set(metrics.EXPORTED)
    queried: set[str] = set()
    for expr in _exprs(dashboard):
        names = metric_names(expr)
        if expr.startswith("label_values("):
            names.discard(expr.rstrip(")").rsplit(",", 1)[1].strip())
        queried |= names
    assert queried, "no queries found"
    unknown = {name for name in queried if exported_name(name) not in exported}
    assert unknown == set(), f"not exported by pagefleet/cluster/metrics.py: {sorted(unknown)}"


def exported_types() -> dict[str, str]:
    """Each exported series' type, from the real metric objects: one replica's registry and
    the router's counters. The autoscaler's series (replicas, target, utilisation acted on)
    are gauges by meaning; they are read here from nothing else while they are being built."""
    from prometheus_client import REGISTRY

    from pagefleet.cluster.routing.serve_common import router_metrics

    router_metrics()  # registers the router's counters in the process registry
    families = [*metrics.ReplicaMetrics("m", "r").families(), *REGISTRY.collect()]
    types = {f.name: f.type for f in families if f.name in metrics.EXPORTED}
    for name in metrics.EXPORTED:
        types.setdefault(name, "gauge")
    return types


def test_suffixes_match_the_metric_types(dashboard: dict[str, Any]) -> None:
    """Counters are queried as _total, histograms by _bucket, gauges bare."""
    types = exported_types()
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:generation_tokens"] == "counter"
    assert types["pagefleet:routed_requests"] == "counter"
    suffix = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
    for expr in _exprs(dashboard):
        for name in metric_names(expr):
            base = exported_name(name)
            if base in types:
                assert name == base + suffix[types[base]], expr


def test_the_panels_the_issue_asks_for(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}

    def panel_querying(*series: str) -> str:
        for title, exprs in by_title.items():
            names = set().union(*(metric_names(e) for e in exprs))
            if set(series) <= names:
                return title
        raise AssertionError(f"no panel queries {series}")

    assert panel_querying("vllm:generation_tokens_total") == "Tokens/s"
    ttft = panel_querying("vllm:time_to_first_token_seconds_bucket")
    itl = panel_querying("vllm:inter_token_latency_seconds_bucket")
    for title in (ttft, itl):
        quantiles = sorted(re.findall(r"histogram_quantile\((0\.\d+)", " ".join(by_title[title])))
        assert quantiles == ["0.5", "0.9", "0.99"], title
    panel_querying("vllm:kv_cache_usage_perc")
    panel_querying("vllm:num_requests_running", "vllm:num_requests_waiting")
    panel_querying(
        "pagefleet:replicas",
        "pagefleet:target_replicas",
        "pagefleet:autoscaler_kv_utilization",
        "pagefleet:autoscaler_compute_utilization",
    )
    panel_querying("pagefleet:routed_requests_total")


def test_per_replica_panels_split_by_replica(dashboard: dict[str, Any]) -> None:
    for panel in dashboard["panels"]:
        if "per replica" in panel["title"]:
            for target in panel["targets"]:
                assert "{{replica}}" in target["legendFormat"], panel["title"]
                assert "sum(" not in target["expr"].replace(" ", ""), panel["title"]


def test_dashboard_is_importable(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "pagefleet" and dashboard["title"] == "pagefleet"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
