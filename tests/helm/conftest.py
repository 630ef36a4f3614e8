"""Render the chart offline with Helm's own Go SDK (helm-python-sdk), and the checks' inputs.

No cluster and no `helm` binary: `helm_python` renders exactly as `helm template` does (schema
validation included), KubeRay's CRD comes from tests/helm/data (a copy kept in the repository), Kubernetes' own schemas from
kubernetes-validate.
"""

from __future__ import annotations

import copy
import json
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

    def deployment(self, name: str) -> dict[str, Any]:
        """The application's `deployments:` entry for `name`."""
        (app,) = self.serve_config["applications"]
        (entry,) = [d for d in app["deployments"] if d["name"] == name]
        return entry

    @property
    def config(self) -> dict[str, Any]:
        """The config the fleet runs: the args with the Ingress's user_config over them
        (what `Ingress.reconfigure` applies)."""
        return {**self.args, **self.deployment("Ingress")["user_config"]}


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


# Kubernetes' own API groups: their objects are checked against Kubernetes' schemas.
KUBE_APIS = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1"}

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _LABELS, "annotations": _LABELS},
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _LABELS},
    "required": ["matchLabels"],
}
_NAMESPACES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
}
_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "targetLabel": {"type": "string"},
    },
}


def _endpoint() -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["port"],
        "properties": {
            "port": {"type": "string"},
            "path": {"type": "string"},
            "interval": _DURATION,
            "scrapeTimeout": _DURATION,
            "relabelings": {"type": "array", "items": _RELABEL},
            # prometheus-operator's SafeAuthorization: a scheme and a Secret's key.
            "authorization": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "type": {"type": "string"},
                    "credentials": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["key"],
                        "properties": {
                            "name": {"type": "string"},
                            "key": {"type": "string"},
                            "optional": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    }


def _kind(api: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": {"type": "object", "additionalProperties": False, **spec},
        },
    }


# The objects of CRDs this repository keeps no copy of (prometheus-operator's
# monitoring.coreos.com/v1, Gateway API's gateway.networking.k8s.io/v1): strict schemas of
# exactly the fields the chart writes, with those CRDs' names and types, so that a misspelt or
# misplaced field fails here as it would be pruned or rejected by the API server.
CRD_OBJECTS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _kind(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NAMESPACES,
                "endpoints": {"type": "array", "minItems": 1, "items": _endpoint()},
            },
        },
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _kind(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NAMESPACES,
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _endpoint(),
                },
            },
        },
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): _kind(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        {
            "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            k: {"type": "string"}
                            for k in ("group", "kind", "namespace", "name", "sectionName")
                        }
                        | {"port": {"type": "integer"}},
                    },
                },
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "path": {
                                            "type": "object",
                                            "additionalProperties": False,
                                            "properties": {
                                                "type": {
                                                    "enum": [
                                                        "Exact",
                                                        "PathPrefix",
                                                        "RegularExpression",
                                                    ]
                                                },
                                                "value": {"type": "string", "pattern": "^/"},
                                            },
                                        }
                                    },
                                },
                            },
                            "backendRefs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["name", "port"],
                                    "properties": {
                                        "name": {"type": "string"},
                                        "port": {"type": "integer"},
                                    },
                                },
                            },
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"request": _DURATION},
                            },
                        },
                    },
                },
            },
        },
    ),
}


def validate_object(obj: dict[str, Any], kube: str) -> None:
    """Check one rendered object strictly: Kubernetes' own kinds against Kubernetes' schemas
    (kubernetes-validate), a RayService against KubeRay's CRD, the monitors and the HTTPRoute
    against CRD_OBJECTS. An object of any other kind fails: nothing goes unchecked."""
    import kubernetes_validate

    key = (obj["apiVersion"], obj["kind"])
    if obj["apiVersion"] in KUBE_APIS:
        kubernetes_validate.validate(obj, kube, strict=True)
    elif key == ("ray.io/v1", "RayService"):
        errors = sorted(rayservice_validator().iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    elif key in CRD_OBJECTS:
        jsonschema.Draft7Validator(CRD_OBJECTS[key]).validate(obj)
    else:
        raise AssertionError(f"no schema to check {key} against")


def kuberay_cluster_key(cluster: dict[str, Any]) -> str:
    """What KubeRay compares to decide whether a RayService change needs a new Ray cluster
    (GenerateHashWithoutReplicasAndWorkersToDelete in ray-operator/controllers/ray/utils/
    util.go): the cluster spec less the worker counts, tolerations and scheduling gates. An
    equal key means the running cluster is kept as it is."""
    spec = copy.deepcopy(cluster)
    spec.pop("upgradeStrategy", None)
    pods = [spec["headGroupSpec"]["template"]["spec"]]
    for group in spec["workerGroupSpecs"]:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
        pods.append(group["template"]["spec"])
    for pod in pods:
        pod.pop("tolerations", None)
        pod.pop("schedulingGates", None)
    return json.dumps(spec, sort_keys=True)
