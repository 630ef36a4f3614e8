"""The chart's security defaults, rendered offline: Ray's token authentication, the
NetworkPolicy (the dashboard and its job API only to KubeRay's operator and the release's
own pods), no service-account token in the Ray containers, a read-only root filesystem with
a writable /tmp, no Ingress or HTTPRoute without an API key unless asked for loudly, and the
header bound in every Serve proxy."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from pagefleet.cluster.http.header_limits import PROXY_CALLBACK_ENV, proxy_env

from .conftest import NAMESPACE, RELEASE, Rendered

TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
KEY = {"apiKeySecret": {"name": "pagefleet-key"}}
INGRESS = {"ingress": {"enabled": True}}
ROUTE = {"httpRoute": {"enabled": True, "parentRefs": [{"name": "public"}]}}


def pods(rendered: Rendered) -> list[dict[str, Any]]:
    return [rendered.head["template"]["spec"], rendered.worker["template"]["spec"]]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_ray_token_authentication_is_on_by_default(render: Any) -> None:
    rendered = render()
    assert rendered.cluster["authOptions"] == {"mode": "token"}
    assert "token authentication is on" in rendered.notes
    own = render({"rayAuth": {"secretName": "ray-token"}})
    assert own.cluster["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    off = render({"rayAuth": {"mode": "disabled"}})
    assert off.cluster["authOptions"] == {"mode": "disabled"}
    assert "WARNING: rayAuth.mode is disabled" in off.notes


def test_the_dashboard_and_rays_ports_are_closed_to_other_pods_by_default(render: Any) -> None:
    rendered = render()
    (policy,) = rendered.kinds("NetworkPolicy")
    rules = policy["spec"]["ingress"]
    dashboard = [r for r in rules if {"port": 8265, "protocol": "TCP"} in r.get("ports", [])]
    assert len(dashboard) == 1
    (operator,) = dashboard[0]["from"]
    assert operator["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}
    }
    open_to_all = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
    assert open_to_all == {8000, 8080}
    # The dashboard listens on the pod's address (the operator reaches it there), behind both.
    assert rendered.head["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_no_service_account_token_but_the_autoscalers(render: Any) -> None:
    rendered = render(
        {
            "config": {"model": "/models/SmolLM2-135M-Instruct", "make_model": None},
            "modelSource": {
                "huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                "pvc": {"create": True},
            },
        }
    )
    (job,) = rendered.kinds("Job")
    for pod in [*pods(rendered), job["spec"]["template"]["spec"]]:
        assert pod["automountServiceAccountToken"] is False
        for c in containers(pod):
            assert all(m["mountPath"] != TOKEN_DIR for m in c.get("volumeMounts", []))
    head = rendered.head["template"]["spec"]
    (volume,) = [v for v in head["volumes"] if v["name"] == "autoscaler-api-token"]
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    mounts = rendered.cluster["autoscalerOptions"]["volumeMounts"]
    assert {"name": "autoscaler-api-token", "mountPath": TOKEN_DIR, "readOnly": True} in mounts
    mounted = render({"automountServiceAccountToken": True})
    for pod in pods(mounted):
        assert pod["automountServiceAccountToken"] is True
        assert all(v["name"] != "autoscaler-api-token" for v in pod["volumes"])


def test_read_only_root_filesystem_with_a_writable_tmp(render: Any) -> None:
    rendered = render()  # the demo: make-model init containers too
    for pod in pods(rendered):
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
        for c in containers(pod):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert env(pod["containers"][0])["XDG_CACHE_HOME"] == "/tmp/cache"
    autoscaler = rendered.cluster["autoscalerOptions"]
    assert autoscaler["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in autoscaler["volumeMounts"]
    sized = render({"tmpSizeLimit": "10Gi"})
    for pod in pods(sized):
        assert {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}} in pod["volumes"]


@pytest.mark.parametrize(("exposure", "key"), [(INGRESS, "ingress"), (ROUTE, "httpRoute")])
def test_an_exposed_endpoint_needs_an_api_key(
    chart: helm_python.Chart, render: Any, exposure: dict[str, Any], key: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError) as err:
        chart.render(exposure, name=RELEASE, namespace=NAMESPACE)
    assert f"{key}.enabled exposes the OpenAI endpoint with no API key" in str(err.value)
    assert "allowUnauthenticated: true" in str(err.value)
    keyed = render({**exposure, **KEY})
    assert "WARNING" not in keyed.notes
    opened = render({**exposure, "allowUnauthenticated": True})
    assert "exposed through the" in opened.notes and "with NO API key" in opened.notes


def test_every_serve_proxy_bounds_request_headers(render: Any) -> None:
    default = render()
    bounded = render({"config": {"limits": {"max_header_bytes": 8192, "max_headers": 50}}})
    for pod in pods(default):
        ray = env(pod["containers"][0])
        assert ray[PROXY_CALLBACK_ENV] == proxy_env(1, 1)[PROXY_CALLBACK_ENV]
        assert "PAGEFLEET_MAX_HEADER_BYTES" not in ray  # ServeConfig's defaults
    for pod in pods(bounded):
        ray = env(pod["containers"][0])
        assert {k: ray[k] for k in proxy_env(8192, 50)} == proxy_env(8192, 50)
