"""Render the chart offline with Helm's own Go SDK (helm-python-sdk), and the checks' inputs.

No cluster and no `helm` binary: `helm_python` renders exactly as `helm template` does (schema
validation included), KubeRay's CRD comes from tests/helm/data (a copy kept in the repository), Kubernetes' own schemas from
kubernetes-validate.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pagefleet"
EXAMPLES = {p.stem: p for p in sorted((CHART / "examples").glob("*.yaml"))}
CRD = Path(__file__).resolve().parent / "data" / "ray.io_rayservices.yaml"
RELEASE = "demo"
NAMESPACE = "llm"


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@dataclass
class Rendered:
    """The manifests of one render: objects by kind, and NOTES.txt."""

    objects: list[dict[str, Any]]
    notes: str

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.kinds(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
        return found[0]

    @property
    def rayservice(self) -> dict[str, Any]:
        return self.one("RayService")

    @property
    def cluster(self) -> dict[str, Any]:
        return self.rayservice["spec"]["rayClusterConfig"]

    @property
    def head(self) -> dict[str, Any]:
        return self.cluster["headGroupSpec"]

    @property
    def worker(self) -> dict[str, Any]:
        groups = self.cluster["workerGroupSpecs"]
        assert len(groups) == 1
        return groups[0]

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def args(self) -> dict[str, Any]:
        (app,) = self.serve_config["applications"]
        return app["args"]


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: helm_python.Chart) -> Any:
    def _render(values: dict[str, Any] | None = None) -> Rendered:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
        objects = []
        notes = ""
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                notes = text
                continue
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return Rendered(objects, notes)

    return _render


def example(name: str) -> dict[str, Any]:
    return load_yaml(EXAMPLES[name])


def chart_values() -> dict[str, Any]:
    return load_yaml(CHART / "values.yaml")


def coalesce(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of user values over the chart's: key by key; a null deletes the key."""
    out = copy.deepcopy(defaults)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = coalesce(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _strict(node: Any) -> Any:
    """KubeRay's CRD with unknown fields rejected (the API server would prune them silently:
    a typo'd field in the chart would vanish, so the test treats it as an error)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def rayservice_validator() -> jsonschema.protocols.Validator:
    crd = load_yaml(CRD)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    # OpenAPI v3.0 schemas are JSON Schema draft 4 plus extensions (x-kubernetes-*).
    return jsonschema.Draft4Validator(_strict(v1["schema"]["openAPIV3Schema"]))
