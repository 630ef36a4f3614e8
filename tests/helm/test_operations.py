"""Running the fleet: replica counts that restart nothing, upgrades and drains that end no
accepted request, security and scheduling, the model downloaded once, monitoring and access."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from pagefleet.cluster.config import parse_config
from pagefleet.cluster.live_settings import INGRESS_USER_CONFIG_KEYS, LIVE_KEYS

from .conftest import (
    CHART,
    NAMESPACE,
    RELEASE,
    Rendered,
    chart_values,
    coalesce,
    example,
    kuberay_cluster_key,
    load_yaml,
    validate_object,
)

FULLNAME = f"{RELEASE}-pagefleet"
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
RAY_POD_LABELS = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/part-of": "pagefleet"}
HUB = {
    "config": {"model": "/models/SmolLM2-135M-Instruct", "make_model": None},
    "modelSource": {
        "huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "pvc": {"create": True, "size": "2Gi"},
    },
}
# Every optional object on, for the checks that each rendered object validates.
EVERYTHING = coalesce(
    HUB,
    {
        "config": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}},
        "modelSource": {"huggingFace": {"tokenSecret": {"name": "hf-token"}}},
        "apiKeySecret": {"name": "pagefleet-key"},
        "worker": {
            "maxReplicas": 6,
            "priorityClassName": "llm-serving",
            "runtimeClassName": "nvidia",
        },
        "head": {"priorityClassName": "llm-control"},
        "imagePullSecrets": [{"name": "regcred"}],
        "upgradeStrategy": {
            "type": "NewClusterWithIncrementalUpgrade",
            "clusterUpgradeOptions": {"gatewayClassName": "istio"},
        },
        "gcsFaultTolerance": {
            "enabled": True,
            "redisAddress": "redis.redis.svc:6379",
            "redisPasswordSecret": {"name": "redis", "key": "password"},
        },
        "podDisruptionBudget": {"head": {"enabled": True}, "worker": {"enabled": True}},
        "networkPolicy": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        "grafana": {"dashboard": {"enabled": True}},
        "ingress": {"enabled": True, "className": "nginx"},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "public"}]},
    },
)


def _pods(rendered: Rendered) -> list[dict[str, Any]]:
    return [rendered.head["template"]["spec"], rendered.worker["template"]["spec"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _render_error(chart: helm_python.Chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmRenderError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(err.value)


# --- every object validates -------------------------------------------------------------


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_object_validates_with_everything_on(render: Any, kube: str) -> None:
    rendered = render(EVERYTHING)
    assert sorted(o["kind"] for o in rendered.objects) == [
        "ConfigMap",
        "HTTPRoute",
        "Ingress",
        "Job",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "PodMonitor",
        "RayService",
        "Service",
        "ServiceMonitor",
    ]
    for obj in rendered.objects:
        validate_object(obj, kube)
    for group in (rendered.head, rendered.worker):
        validate_object({"apiVersion": "v1", "kind": "Pod", **group["template"]}, kube)


def test_the_crd_object_check_catches_a_misspelt_field(render: Any) -> None:
    monitor = copy.deepcopy(render(EVERYTHING).one("PodMonitor"))
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(Exception, match="podMetricEndpoints"):
        validate_object(monitor, KUBE_VERSIONS[-1])


def test_schema_covers_every_value_and_values_every_key() -> None:
    """values.schema.json's chart part and values.yaml stay in step: every top-level key is in
    both (the schema rejects unknown keys, so values.yaml cannot hold one it lacks)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]) - {"global"} == set(chart_values())


# --- 1. a replica-count change restarts nothing -----------------------------------------

BOUNDS_PAIRS = {
    "fixed fleet": ({"config": {"replicas": 2}}, {"config": {"replicas": 5}}),
    "autoscaling bounds": (
        {"config": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}},
        {"config": {"autoscaling": {"min_replicas": 2, "max_replicas": 12, "initial_replicas": 3}}},
    ),
    "fixed to autoscaling": (
        {"config": {"replicas": 3}},
        {"config": {"autoscaling": {"min_replicas": 0, "max_replicas": 6}}},
    ),
    "gpu example": (
        example("gpu-tp2-autoscaling"),
        coalesce(
            example("gpu-tp2-autoscaling"),
            {"config": {"autoscaling": {"min_replicas": 2, "max_replicas": 10}}},
        ),
    ),
}
_BOUND_KEYS = ("replicas", "autoscaling")


def _deployments(serve: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in serve["applications"][0]["deployments"]}


def _without_deployments(serve: dict[str, Any]) -> dict[str, Any]:
    serve = copy.deepcopy(serve)
    del serve["applications"][0]["deployments"]
    return serve


def _spec_without_serve_and_counts(rendered: Any) -> dict[str, Any]:
    spec = {k: v for k, v in rendered.rayservice["spec"].items() if k != "serveConfigV2"}
    spec = copy.deepcopy(spec)
    for group in spec["rayClusterConfig"]["workerGroupSpecs"]:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key)
    return spec


@pytest.mark.parametrize("pair", list(BOUNDS_PAIRS))
def test_replica_bounds_change_only_the_serve_config(render: Any, pair: str) -> None:
    before, after = (render(v) for v in BOUNDS_PAIRS[pair])
    # What KubeRay hashes (worker groups' replicas / minReplicas / maxReplicas / workersToDelete
    # cleared) is identical: the running cluster is kept, no pod restarts.
    assert kuberay_cluster_key(before.cluster) == kuberay_cluster_key(after.cluster)
    # The application's args (Serve's code version) are identical: no replica restarts. The
    # bounds are deployment options only, which Serve applies in place.
    assert before.args == after.args
    assert not set(_BOUND_KEYS) & set(before.args)
    assert _without_deployments(before.serve_config) == _without_deployments(after.serve_config)
    b, a = _deployments(before.serve_config), _deployments(after.serve_config)
    engine_changed = {
        k
        for k in set(b["EngineReplica"]) | set(a["EngineReplica"])
        if b["EngineReplica"].get(k) != a["EngineReplica"].get(k)
    }
    assert engine_changed and engine_changed <= {"num_replicas", "autoscaling_config"}
    ingress_changed = {
        k
        for k in set(b["Ingress"]) | set(a["Ingress"])
        if b["Ingress"].get(k) != a["Ingress"].get(k)
    }
    # The ingress learns the bounds (user_config) and its room follows the fleet's largest size.
    assert ingress_changed <= {"user_config", "max_ongoing_requests"}
    user_changed = {
        k
        for k in set(b["Ingress"]["user_config"]) | set(a["Ingress"]["user_config"])
        if b["Ingress"]["user_config"].get(k) != a["Ingress"]["user_config"].get(k)
    }
    assert user_changed and user_changed <= set(_BOUND_KEYS)
    # Nothing else in the RayService moves either.
    assert _spec_without_serve_and_counts(before) == _spec_without_serve_and_counts(after)


LIVE_PAIRS = {
    "a limit": ({}, {"config": {"limits": {"max_n": 1}}}),
    "limits and the metrics' key": (
        {"config": {"limits": {"max_stop": 4}}},
        {"config": {"limits": {"max_stop": 2, "max_prompts": 8}, "protect_metrics": True}},
    ),
}


@pytest.mark.parametrize("pair", list(LIVE_PAIRS))
def test_live_settings_change_only_the_ingress_user_config(render: Any, pair: str) -> None:
    before, after = (render(v) for v in LIVE_PAIRS[pair])
    assert before.args == after.args  # Serve's code version: no replica restarts
    assert not set(LIVE_KEYS) & set(before.args)
    assert _without_deployments(before.serve_config) == _without_deployments(after.serve_config)
    b, a = _deployments(before.serve_config), _deployments(after.serve_config)
    # Only the Ingress's user_config differs (Serve calls Ingress.reconfigure with it).
    assert b["EngineReplica"] == a["EngineReplica"]
    assert {k: v for k, v in b["Ingress"].items() if k != "user_config"} == {
        k: v for k, v in a["Ingress"].items() if k != "user_config"
    }
    assert b["Ingress"]["user_config"] != a["Ingress"]["user_config"]
    assert set(a["Ingress"]["user_config"]) <= set(INGRESS_USER_CONFIG_KEYS)
    # And nothing outside serveConfigV2: the same cluster, the same pods.
    spec_before = {k: v for k, v in before.rayservice["spec"].items() if k != "serveConfigV2"}
    spec_after = {k: v for k, v in after.rayservice["spec"].items() if k != "serveConfigV2"}
    assert spec_before == spec_after
    assert (
        parse_config(after.config).limits
        == parse_config({**after.args, **after.deployment("Ingress")["user_config"]}).limits
    )


def test_worker_group_is_the_autoscalers(render: Any) -> None:
    for values, serve_max in (({"config": {"replicas": 3}}, 3), ({}, 1)):
        rendered = render(values)
        assert rendered.cluster["enableInTreeAutoscaling"] is True  # also for a fixed fleet
        worker = rendered.worker
        assert (worker["minReplicas"], worker["maxReplicas"], worker["replicas"]) == (
            0,
            serve_max,
            serve_max,
        )
        # The counts are nowhere in the pod template (a count change would make a new cluster).
        assert "annotations" not in worker["template"]["metadata"]
        assert "pagefleet/worker-replicas" not in json.dumps(rendered.rayservice)
    rendered = render(
        {"config": {"autoscaling": {"max_replicas": 8}}, "worker": {"maxReplicas": 12}}
    )
    assert (rendered.worker["minReplicas"], rendered.worker["maxReplicas"]) == (0, 12)
    assert parse_config(rendered.config).autoscaling.max_replicas == 8  # type: ignore[union-attr]
    # The ceiling is KubeRay's unhashed field too: raising it alone keeps the cluster.
    assert kuberay_cluster_key(rendered.cluster) == kuberay_cluster_key(
        render({"config": {"autoscaling": {"max_replicas": 8}}}).cluster
    )


def test_cluster_changes_still_make_a_new_cluster(render: Any) -> None:
    """The key the bounds test relies on does see what KubeRay hashes."""
    base = kuberay_cluster_key(render().cluster)
    assert kuberay_cluster_key(render({"image": {"tag": "0.2.0"}}).cluster) != base
    assert (
        kuberay_cluster_key(
            render({"worker": {"rayStartParams": {"object-store-memory": "1"}}}).cluster
        )
        != base
    )
    # An application-only change keeps it.
    rendered = render({"config": {"engine": {"max_num_seqs": 64}, "routing": "round_robin"}})
    assert kuberay_cluster_key(rendered.cluster) == base


# --- 2. upgrades and drains that end no accepted request --------------------------------


def test_upgrade_strategy(render: Any) -> None:
    assert render().rayservice["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    held = render({"upgradeStrategy": {"type": "None"}}).rayservice
    assert held["spec"]["upgradeStrategy"] == {"type": "None"}
    validate_object(held, KUBE_VERSIONS[-1])
    incremental = render(
        {
            "upgradeStrategy": {
                "type": "NewClusterWithIncrementalUpgrade",
                "clusterUpgradeOptions": {"gatewayClassName": "istio", "stepSizePercent": 10},
            }
        }
    ).rayservice
    assert incremental["spec"]["upgradeStrategy"] == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {
            "gatewayClassName": "istio",
            "stepSizePercent": 10,
            "intervalSeconds": 60,
            "maxSurgePercent": 100,
        },
    }
    validate_object(incremental, KUBE_VERSIONS[-1])
    # KubeRay requires its autoscaler for the incremental strategy: always on here.
    assert incremental["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


DRAIN_CASES = {
    # config -> (drain time, deletion delay, grace period)
    "defaults": ({}, 600, 630, 630),
    "longer timeout": ({"request_timeout_s": 900}, 900, 930, 930),
    "longer drain": ({"drain_timeout_s": 1200.5}, 1201, 1231, 1231),
    "short timeout": ({"request_timeout_s": 5, "drain_timeout_s": 20}, 20, 50, 50),
}


@pytest.mark.parametrize("case", list(DRAIN_CASES))
def test_old_cluster_and_pods_outlive_the_drain(render: Any, case: str) -> None:
    config, drain, delay, grace = DRAIN_CASES[case]
    rendered = render({"config": config})
    parsed = parse_config(rendered.config)
    assert drain == int(-(-parsed.drain_s // 1))  # ServeConfig's drain_s, rounded up
    assert rendered.rayservice["spec"]["rayClusterDeletionDelaySeconds"] == delay
    assert delay >= (parsed.request_timeout_s or 0)
    for pod in _pods(rendered):
        assert pod["terminationGracePeriodSeconds"] == grace >= parsed.drain_s


def test_drain_values_can_be_pinned(render: Any) -> None:
    rendered = render({"rayClusterDeletionDelaySeconds": 600, "terminationGracePeriodSeconds": 900})
    assert rendered.rayservice["spec"]["rayClusterDeletionDelaySeconds"] == 600
    assert {p["terminationGracePeriodSeconds"] for p in _pods(rendered)} == {900}
    # A pinned grace period keeps the cluster when the time-outs change.
    longer = render({"terminationGracePeriodSeconds": 900, "config": {"request_timeout_s": 800}})
    assert kuberay_cluster_key(longer.cluster) == kuberay_cluster_key(rendered.cluster)


def test_gcs_fault_tolerance(render: Any) -> None:
    assert "gcsFaultToleranceOptions" not in render().cluster
    rendered = render(
        {
            "gcsFaultTolerance": {
                "enabled": True,
                "redisAddress": "redis-master.redis.svc:6379",
                "redisPasswordSecret": {"name": "redis", "key": "redis-password"},
            }
        }
    )
    assert rendered.cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc:6379",
        "redisPassword": {
            "valueFrom": {"secretKeyRef": {"name": "redis", "key": "redis-password"}}
        },
    }
    validate_object(rendered.rayservice, KUBE_VERSIONS[-1])
    # The password reaches no pod as a literal, and KubeRay's own env names stay unset.
    text = json.dumps(rendered.rayservice)
    assert "REDIS_PASSWORD" not in text and "RAY_REDIS_ADDRESS" not in text
    plain = render({"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"}})
    assert plain.cluster["gcsFaultToleranceOptions"] == {"redisAddress": "redis:6379"}


def test_pod_disruption_budgets(render: Any) -> None:
    assert render().kinds("PodDisruptionBudget") == []
    rendered = render(
        {
            "podDisruptionBudget": {
                "head": {"enabled": True},
                "worker": {"enabled": True, "maxUnavailable": "25%"},
            }
        }
    )
    head = rendered.one("PodDisruptionBudget", f"{FULLNAME}-head")
    engine = rendered.one("PodDisruptionBudget", f"{FULLNAME}-engine")
    assert head["spec"] == {
        "maxUnavailable": 0,
        "selector": {"matchLabels": {**RAY_POD_LABELS, "app.kubernetes.io/component": "ray-head"}},
    }
    assert engine["spec"] == {
        "maxUnavailable": "25%",
        "selector": {
            "matchLabels": {**RAY_POD_LABELS, "app.kubernetes.io/component": "ray-worker"}
        },
    }
    # Each selects its own group's pods and not the other's.
    head_labels = rendered.head["template"]["metadata"]["labels"]
    worker_labels = rendered.worker["template"]["metadata"]["labels"]
    assert head["spec"]["selector"]["matchLabels"].items() <= head_labels.items()
    assert engine["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
    assert not engine["spec"]["selector"]["matchLabels"].items() <= head_labels.items()
    for obj in (head, engine):
        for kube in KUBE_VERSIONS:
            validate_object(obj, kube)


# --- 3. security and scheduling ---------------------------------------------------------

NON_ROOT_POD = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 100,
    "fsGroup": 100,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
NO_PRIVILEGES = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def test_pods_run_as_ray_non_root(render: Any) -> None:
    rendered = render(HUB)
    (job,) = rendered.kinds("Job")
    pods = [*_pods(rendered), job["spec"]["template"]["spec"]]
    for pod in pods:
        assert pod["securityContext"] == NON_ROOT_POD
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert container["securityContext"] == NO_PRIVILEGES
    # KubeRay's autoscaler sidecar too, unless autoscalerOptions says otherwise.
    assert rendered.cluster["autoscalerOptions"]["securityContext"] == NO_PRIVILEGES
    own = render({"autoscalerOptions": {"securityContext": {"runAsUser": 2000}}})
    assert own.cluster["autoscalerOptions"]["securityContext"] == {"runAsUser": 2000}
    # The demo's make-model init container writes as the same user, into the same volume.
    (init,) = render().worker["template"]["spec"]["initContainers"]
    assert init["securityContext"] == NO_PRIVILEGES


def test_security_contexts_are_values(render: Any) -> None:
    """Helm merges the values over the defaults key by key: a null drops a key."""
    rendered = render(
        {
            "podSecurityContext": {
                "runAsUser": 1234,
                "runAsGroup": None,
                "fsGroupChangePolicy": None,
                "seccompProfile": None,
            },
            "containerSecurityContext": {
                "allowPrivilegeEscalation": None,
                "readOnlyRootFilesystem": None,
                "capabilities": None,
            },
        }
    )
    for pod in _pods(rendered):
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1234, "fsGroup": 100}
        assert "securityContext" not in pod["containers"][0]
    assert "securityContext" not in rendered.cluster["autoscalerOptions"]


def test_runtime_and_priority_classes_and_pull_secrets(render: Any) -> None:
    rendered = render(EVERYTHING)
    head, worker = _pods(rendered)
    assert head["priorityClassName"] == "llm-control" and "runtimeClassName" not in head
    assert worker["priorityClassName"] == "llm-serving"
    assert worker["runtimeClassName"] == "nvidia"
    (job,) = rendered.kinds("Job")
    for pod in (head, worker, job["spec"]["template"]["spec"]):
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    plain = render()
    for pod in _pods(plain):
        assert not {"priorityClassName", "runtimeClassName", "imagePullSecrets"} & set(pod)


@pytest.mark.parametrize("strategy", ["PACK", "STRICT_PACK"])
def test_tensor_parallel_packs(render: Any, strategy: str) -> None:
    rendered = render(
        {
            "config": {
                "replica_resources": {"placement_group_strategy": strategy},
                "engine": {"tensor_parallel_size": 2},
            },
            "worker": {"resources": {"requests": {"cpu": "2"}}},
        }
    )
    assert rendered.args["replica_resources"]["placement_group_strategy"] == strategy


def test_ray_cpus_within_the_pods_request(render: Any) -> None:
    # Equal is fine; the limit stands in for an unset request (Kubernetes' default).
    render(
        {
            "config": {"replica_resources": {"num_cpus": 2}},
            "worker": {"resources": {"requests": {"cpu": "2000m"}}},
        }
    )
    render(
        {
            "config": {"replica_resources": {"num_cpus": 2}},
            "worker": {"resources": {"requests": None, "limits": {"cpu": 2, "memory": "4Gi"}}},
        }
    )
    render({"head": {"rayStartParams": {"num-cpus": "1"}}})  # the head requests 1


def test_network_policy_closes_rays_ports(render: Any) -> None:
    assert render({"networkPolicy": {"enabled": False}}).kinds("NetworkPolicy") == []
    rendered = render()  # on by default
    policy = rendered.one("NetworkPolicy", f"{FULLNAME}-ray")
    assert policy["spec"] == {
        "podSelector": {"matchLabels": RAY_POD_LABELS},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": RAY_POD_LABELS}}]},
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}
                        },
                        "podSelector": {
                            "matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}
                        },
                    }
                ],
                "ports": [{"port": 8265, "protocol": "TCP"}],
            },
            {"ports": [{"port": 8000, "protocol": "TCP"}]},
            {"ports": [{"port": 8080, "protocol": "TCP"}]},
        ],
    }
    # Every Ray pod is behind it; Ray's ports open to no peer outside the release's pods.
    for group in (rendered.head, rendered.worker):
        assert RAY_POD_LABELS.items() <= group["template"]["metadata"]["labels"].items()
    open_to_all = {
        p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]
    }
    assert open_to_all == {8000, 8080}
    assert not open_to_all & {6379, 8265, 10001}
    for kube in KUBE_VERSIONS:
        validate_object(policy, kube)
    peers = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    narrowed = render(
        {
            "config": {"port": 9000},
            "networkPolicy": {"enabled": True, "serveFrom": peers, "metricsFrom": peers},
        }
    ).one("NetworkPolicy")
    assert narrowed["spec"]["ingress"][2:] == [
        {"ports": [{"port": 9000, "protocol": "TCP"}], "from": peers},
        {"ports": [{"port": 8080, "protocol": "TCP"}], "from": peers},
    ]


# --- 4. the model downloaded once -------------------------------------------------------


def test_hub_model_is_downloaded_once_by_a_hook_job(render: Any) -> None:
    rendered = render(
        coalesce(HUB, {"modelSource": {"huggingFace": {"tokenSecret": {"name": "hf-token"}}}})
    )
    claim = f"{FULLNAME}-models"
    pvc = rendered.one("PersistentVolumeClaim", claim)
    assert pvc["metadata"]["annotations"] == {
        "helm.sh/hook": "pre-install,pre-upgrade",
        "helm.sh/hook-weight": "-10",
        "helm.sh/resource-policy": "keep",
    }
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "2Gi"}},
    }
    job = rendered.one("Job", f"{FULLNAME}-model-download")
    assert job["metadata"]["annotations"] == {
        "helm.sh/hook": "pre-install,pre-upgrade",
        "helm.sh/hook-weight": "0",
        "helm.sh/hook-delete-policy": "before-hook-creation",
    }
    spec = job["spec"]["template"]["spec"]
    (download,) = spec["containers"]
    env = _env(download)
    assert env["HF_REPO"]["value"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert env["MODEL_DIR"]["value"] == "/models/SmolLM2-135M-Instruct"
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
    }
    assert spec["volumes"] == [
        {"name": "models", "persistentVolumeClaim": {"claimName": claim}},
        {"name": "tmp", "emptyDir": {}},
    ]
    assert download["volumeMounts"] == [
        {"name": "models", "mountPath": "/models"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    assert spec["restartPolicy"] == "Never"
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"]) == (3, 7200)
    # The Job's pod is none of the Ray pods' selectors' (no part-of label).
    assert "app.kubernetes.io/part-of" not in job["spec"]["template"]["metadata"]["labels"]
    # The Ray pods: no init container, the claim read-only, offline, no token.
    for pod in _pods(rendered):
        assert "initContainers" not in pod
        assert {"name": "models", "persistentVolumeClaim": {"claimName": claim}} in pod["volumes"]
        ray = pod["containers"][0]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in ray["volumeMounts"]
        assert _env(ray)["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "1"}
        assert "HF_TOKEN" not in _env(ray)


def test_existing_claim_is_used_as_it_is(render: Any) -> None:
    values = coalesce(
        HUB, {"modelSource": {"pvc": {"create": False, "claimName": "models", "readOnly": False}}}
    )
    rendered = render(values)
    assert rendered.kinds("PersistentVolumeClaim") == []
    (job,) = rendered.kinds("Job")
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "models"
    }
    for pod in _pods(rendered):
        assert {"name": "models", "mountPath": "/models"} in pod["containers"][0]["volumeMounts"]
    # A named claim the chart creates.
    named = render(
        coalesce(
            HUB,
            {"modelSource": {"pvc": {"claimName": "llm-models", "storageClassName": "filestore"}}},
        )
    )
    pvc = named.one("PersistentVolumeClaim", "llm-models")
    assert pvc["spec"]["storageClassName"] == "filestore"
    # A claim alone (the model already on it): no Job.
    assert (
        render(
            {"config": {"make_model": None}, "modelSource": {"pvc": {"claimName": "models"}}}
        ).kinds("Job")
        == []
    )


def test_hf_hub_offline_is_the_users_to_override(render: Any) -> None:
    rendered = render({"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]})
    for pod in _pods(rendered):
        offline = [e for e in pod["containers"][0]["env"] if e["name"] == "HF_HUB_OFFLINE"]
        assert offline == [{"name": "HF_HUB_OFFLINE", "value": "0"}]


def test_download_script_fetches_what_pagefleet_reads(render: Any, tmp_path: Path) -> None:
    """Run the Job's own script against a stand-in `huggingface_hub` (no Hub here)."""
    fake = tmp_path / "fake" / "huggingface_hub"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import json, os\n"
        "def snapshot_download(repo_id, revision=None, local_dir=None, allow_patterns=None):\n"
        "    with open(os.environ['RECORD'], 'w') as f:\n"
        "        json.dump([repo_id, revision, local_dir, allow_patterns], f)\n"
    )
    for revision, expected in (("", None), ("v1", "v1")):
        values = coalesce(HUB, {"modelSource": {"huggingFace": {"revision": revision}}})
        (job,) = render(values).kinds("Job")
        (download,) = job["spec"]["template"]["spec"]["containers"]
        assert download["command"] == ["python", "-c"]
        env = {k: e["value"] for k, e in _env(download).items() if "value" in e}
        record = tmp_path / "record.json"
        env |= {"PYTHONPATH": str(fake.parent), "RECORD": str(record), "PATH": os.environ["PATH"]}
        subprocess.run([sys.executable, "-c", download["args"][0]], env=env, check=True, timeout=60)
        assert json.loads(record.read_text()) == [
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            expected,
            "/models/SmolLM2-135M-Instruct",
            ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.safetensors"],
        ]


def test_no_pod_downloads_from_the_hub(render: Any) -> None:
    """No init container anywhere fetches from the Hub: only the hook Job does."""
    for values in (HUB, example("cpu"), example("gpu-tp2-autoscaling")):
        rendered = render(values)
        for pod in _pods(rendered):
            for init in pod.get("initContainers", []):
                assert "snapshot_download" not in json.dumps(init)
        assert len(rendered.kinds("Job")) == 1


# --- 5. monitoring and access -----------------------------------------------------------


def test_pod_monitor_scrapes_rays_metrics_port(render: Any) -> None:
    assert render().kinds("PodMonitor") == []
    rendered = render({"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
    monitor = rendered.one("PodMonitor", f"{FULLNAME}-ray")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"] == {
        "selector": {"matchLabels": RAY_POD_LABELS},
        "namespaceSelector": {"matchNames": [NAMESPACE]},
        "podMetricsEndpoints": [
            {
                "port": "metrics",
                "path": "/metrics",
                "interval": "15s",
                "scrapeTimeout": "10s",
                "relabelings": [
                    {
                        "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                        "targetLabel": "ray_io_cluster",
                    },
                    {
                        "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_node_type"],
                        "targetLabel": "ray_io_node_type",
                    },
                ],
            }
        ],
    }
    # Every Ray container names the port it scrapes: Ray's metrics-export-port, 8080.
    for pod in _pods(rendered):
        ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
        assert ports["metrics"] == 8080
    # The ServiceMonitor sits beside it.
    both = render(
        {"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    )
    assert len(both.kinds("PodMonitor")) == len(both.kinds("ServiceMonitor")) == 1


def test_ingress_for_the_openai_endpoint(render: Any) -> None:
    assert render().kinds("Ingress") == []
    rendered = render(
        {
            "apiKeySecret": {"name": "pagefleet-key"},
            "service": {"port": 80},
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "660"},
                "hosts": [
                    {"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]}
                ],
                "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}],
            },
        }
    )
    ingress = rendered.one("Ingress", FULLNAME)
    assert ingress["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "660"
    }
    assert ingress["spec"] == {
        "ingressClassName": "nginx",
        "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}],
        "rules": [
            {
                "host": "llm.example.com",
                "http": {
                    "paths": [
                        {
                            "path": "/v1",
                            "pathType": "Prefix",
                            "backend": {"service": {"name": FULLNAME, "port": {"number": 80}}},
                        }
                    ]
                },
            }
        ],
    }
    # The backend is the Service KubeRay makes from serveService.
    assert rendered.rayservice["spec"]["serveService"]["metadata"]["name"] == FULLNAME
    default = render({"ingress": {"enabled": True}, "allowUnauthenticated": True}).one("Ingress")
    assert default["spec"]["rules"] == [
        {
            "http": {
                "paths": [
                    {
                        "path": "/",
                        "pathType": "Prefix",
                        "backend": {"service": {"name": FULLNAME, "port": {"number": 8000}}},
                    }
                ]
            }
        }
    ]
    for obj in (ingress, default):
        for kube in KUBE_VERSIONS:
            validate_object(obj, kube)


def test_http_route_for_the_openai_endpoint(render: Any) -> None:
    assert render().kinds("HTTPRoute") == []
    rendered = render(
        {
            "apiKeySecret": {"name": "pagefleet-key"},
            "httpRoute": {
                "enabled": True,
                "parentRefs": [{"name": "public", "namespace": "gateways", "sectionName": "https"}],
                "hostnames": ["llm.example.com"],
                "requestTimeout": "660s",
            },
        }
    )
    route = rendered.one("HTTPRoute", FULLNAME)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"] == {
        "parentRefs": [{"name": "public", "namespace": "gateways", "sectionName": "https"}],
        "hostnames": ["llm.example.com"],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"name": FULLNAME, "port": 8000}],
                "timeouts": {"request": "660s"},
            }
        ],
    }
    validate_object(route, KUBE_VERSIONS[-1])


# --- bad values fail the render, naming the field ---------------------------------------

OPERATIONS_ERRORS = {
    "ceiling below Serve's max": (
        {"config": {"autoscaling": {"max_replicas": 8}}, "worker": {"maxReplicas": 4}},
        "worker.maxReplicas (4) is below the 8 engine replicas Serve may run "
        "(config.autoscaling.max_replicas)",
    ),
    "ceiling below a fixed fleet": (
        {"config": {"replicas": 3}, "worker": {"maxReplicas": 2}},
        "worker.maxReplicas (2) is below the 3 engine replicas Serve may run (config.replicas)",
    ),
    "deletion delay shorter than the request time-out": (
        {"rayClusterDeletionDelaySeconds": 60},
        "rayClusterDeletionDelaySeconds (60) must be at least config.request_timeout_s (600)",
    ),
    "grace period shorter than the drain": (
        {"terminationGracePeriodSeconds": 30, "config": {"drain_timeout_s": 900}},
        "terminationGracePeriodSeconds (30) must be at least the drain time, "
        "max(config.drain_timeout_s, config.request_timeout_s) = 900",
    ),
    "incremental upgrade without a gateway class": (
        {"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"}},
        "upgradeStrategy.clusterUpgradeOptions.gatewayClassName is required",
    ),
    "GCS fault tolerance without Redis": (
        {"gcsFaultTolerance": {"enabled": True}},
        "gcsFaultTolerance.redisAddress is required with gcsFaultTolerance.enabled",
    ),
    "tensor parallel spread over nodes": (
        {
            "config": {
                "replica_resources": {"placement_group_strategy": "SPREAD"},
                "engine": {"tensor_parallel_size": 2},
            },
            "worker": {"resources": {"requests": {"cpu": "2"}}},
        },
        "config.replica_resources.placement_group_strategy (SPREAD) must be PACK or STRICT_PACK "
        "with config.engine.tensor_parallel_size 2",
    ),
    "tensor parallel strictly spread": (
        {
            "config": {
                "replica_resources": {"placement_group_strategy": "STRICT_SPREAD"},
                "engine": {"tensor_parallel_size": 4},
            },
        },
        "config.replica_resources.placement_group_strategy (STRICT_SPREAD) must be PACK or "
        "STRICT_PACK",
    ),
    "Ray CPUs above the worker's request": (
        {
            "config": {"replica_resources": {"num_cpus": 4}},
            "worker": {"resources": {"requests": {"cpu": "3500m"}}},
        },
        "Ray's num-cpus on the worker (4) is larger than worker.resources.requests.cpu (3500m)",
    ),
    "Ray CPUs above the head's request": (
        {"head": {"rayStartParams": {"num-cpus": "2"}}},
        "Ray's num-cpus on the head (2) is larger than head.resources.requests.cpu (1)",
    ),
    "no CPU request at all": (
        {"worker": {"resources": {"requests": None, "limits": None}}},
        "worker.resources.requests.cpu is unset, but Ray's num-cpus on the worker is 1",
    ),
    "Hub download without a claim": (
        {
            "config": {"model": "/models/m", "make_model": None},
            "modelSource": {"huggingFace": {"repo": "org/m"}},
        },
        "modelSource.huggingFace.repo is downloaded once into a PVC: set "
        "modelSource.pvc.create=true",
    ),
    "HTTPRoute without a Gateway": (
        {"httpRoute": {"enabled": True}, "apiKeySecret": {"name": "pagefleet-key"}},
        "httpRoute.parentRefs must name at least one Gateway",
    ),
}


@pytest.mark.parametrize("case", list(OPERATIONS_ERRORS))
def test_operations_values_fail_the_render(chart: helm_python.Chart, case: str) -> None:
    values, message = OPERATIONS_ERRORS[case]
    assert message in _render_error(chart, values)


SCHEMA_ERRORS = {
    "unknown upgrade strategy": (
        {"upgradeStrategy": {"type": "Recreate"}},
        "at '/upgradeStrategy/type'",
    ),
    "ceiling of zero": ({"worker": {"maxReplicas": 0}}, "at '/worker/maxReplicas'"),
    "Redis password as a literal": (
        {"gcsFaultTolerance": {"enabled": True, "redisPassword": "x"}},
        "at '/gcsFaultTolerance': additional properties 'redisPassword' not allowed",
    ),
    "bad access mode": (
        {"modelSource": {"pvc": {"accessModes": ["ReadWriteAll"]}}},
        "at '/modelSource/pvc/accessModes/0'",
    ),
}


@pytest.mark.parametrize("case", list(SCHEMA_ERRORS))
def test_operations_values_fail_the_schema(chart: helm_python.Chart, case: str) -> None:
    values, message = SCHEMA_ERRORS[case]
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


# --- the README says what applies in place and what restarts what -----------------------


def test_readme_documents_restarts_and_the_ceiling() -> None:
    readme = (CHART / "README.md").read_text()
    for heading in ("### What applies in place, what restarts", "### Raising the ceiling"):
        assert heading in readme
    values = load_yaml(CHART / "values.yaml")
    for key in ("upgradeStrategy", "networkPolicy", "podDisruptionBudget", "gcsFaultTolerance"):
        assert key in values and f"`{key}" in readme
    assert "pagefleet/worker-replicas" not in readme
