"""The chart renders what KubeRay and Kubernetes accept, and the fleet its values describe."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from pagefleet.cluster.autoscaling import AutoscalingPolicyConfig
from pagefleet.cluster.config import AutoscalingSettings, ServeConfig, parse_config
from pagefleet.cluster.live_settings import (
    INGRESS_USER_CONFIG_KEYS,
    engine_scaling_options,
    ingress_max_ongoing_requests,
)

from .conftest import (
    CHART,
    CRD,
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    REPO,
    Rendered,
    chart_values,
    coalesce,
    example,
    load_yaml,
    rayservice_validator,
    validate_object,
)

FULLNAME = f"{RELEASE}-pagefleet"
# The Kubernetes versions the core objects are checked against: the chart's floor and the
# newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
CASES = {"defaults": {}, **{name: example(name) for name in EXAMPLES}}


def _load_generator() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "generate_schema", REPO / "helm" / "generate_schema.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    spec = group["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --- the chart as a package -------------------------------------------------------------


def test_examples_exist() -> None:
    assert set(EXAMPLES) == {"cpu", "gpu-tp2-autoscaling"}


def test_app_version_is_the_package_version() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    meta = load_yaml(CHART / "Chart.yaml")
    assert meta["appVersion"] == pyproject["project"]["version"]
    assert meta["apiVersion"] == "v2" and meta["name"] == "pagefleet"


@pytest.mark.parametrize("case", list(CASES))
def test_lint_is_clean(case: str) -> None:
    report = helm_python.lint(CHART, CASES[case] or None, strict=True)
    assert report["errors"] == []
    # Severity 1 is informational (only "icon is recommended"); warnings and errors are not.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_schema_config_part_is_generated_from_serveconfig() -> None:
    generator = _load_generator()
    text = (CHART / "values.schema.json").read_text()
    assert text == generator.render(json.loads(text)), (
        "values.schema.json is out of date with ServeConfig: run python helm/generate_schema.py"
    )
    config = json.loads(text)["properties"]["config"]
    assert set(config["properties"]) == set(ServeConfig.model_fields) - set(generator.SECRET_FIELDS)
    assert config["additionalProperties"] is False and config["required"] == ["model"]


# --- what KubeRay and Kubernetes accept -------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_rayservice_matches_kuberays_crd(render: Any, case: str) -> None:
    assert CRD.is_file(), f"{CRD} is missing (KubeRay's CRD, kept in tests/helm/data)"
    rayservice = render(CASES[case]).rayservice
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    errors = sorted(rayservice_validator().iter_errors(rayservice), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_crd_check_catches_a_misspelt_field(render: Any) -> None:
    rayservice = copy.deepcopy(render().rayservice)
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    errors = list(rayservice_validator().iter_errors(rayservice))
    assert [e.validator for e in errors] == ["additionalProperties"]
    assert "'maxReplica' was unexpected" in errors[0].message


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_core_objects_validate(render: Any, case: str, kube: str) -> None:
    rendered = render({**CASES[case], "grafana": {"dashboard": {"enabled": True}}})
    kinds = sorted(o["kind"] for o in rendered.objects)
    expected = ["ConfigMap", "NetworkPolicy", "RayService", "Service"]
    if case == "cpu":  # the Hub model: a claim the chart makes, and the download Job
        expected = [
            "ConfigMap",
            "Job",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "RayService",
            "Service",
        ]
    if case == "gpu-tp2-autoscaling":  # an existing claim; PDB and monitors on
        expected = [
            "ConfigMap",
            "Job",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodMonitor",
            "RayService",
            "Service",
            "ServiceMonitor",
        ]
    assert kinds == expected
    # Every object, and the OpenAI Service (KubeRay creates it from serveService) and the Ray
    # pods (from the group templates): core objects against Kubernetes' schemas, the rest
    # against their CRDs.
    for obj in rendered.objects:
        validate_object(obj, kube)
    serve = rendered.rayservice["spec"]["serveService"]
    validate_object({"apiVersion": "v1", "kind": "Service", **serve}, kube)
    for group in (rendered.head, rendered.worker):
        validate_object({"apiVersion": "v1", "kind": "Pod", **group["template"]}, kube)


# --- serveConfigV2: one application, pagefleet's config as it is ------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_serve_config_is_one_application_with_the_config_as_args(render: Any, case: str) -> None:
    rendered = render(CASES[case])
    serve = rendered.serve_config
    assert set(serve) == {"applications", "http_options", "proxy_location"}
    (app,) = serve["applications"]
    assert app["import_path"] == "pagefleet.cluster.app:build_app"
    assert app["route_prefix"] == "/"
    # Exactly the values' config after Helm's merge (a null drops a default), nothing added:
    # the args without what changes in place, which is the Ingress's user_config.
    expected = coalesce(chart_values()["config"], CASES[case].get("config", {}))
    in_place = set(INGRESS_USER_CONFIG_KEYS)
    assert app["args"] == {k: v for k, v in expected.items() if k not in in_place}
    assert rendered.deployment("Ingress")["user_config"] == {
        k: v for k, v in expected.items() if k in in_place
    }
    assert rendered.config == expected
    # build_app's own parser accepts the args alone, and the whole.
    parse_config(dict(app["args"]))
    config = parse_config(rendered.config)
    assert serve["http_options"] == {"host": "0.0.0.0", "port": config.port}
    # The deployments' options are the ones build_app sets from the whole config.
    engine = _policy_filled_in(rendered.deployment("EngineReplica"))
    drain = -(-config.drain_s // 1)
    assert engine == {**engine_scaling_options(config), "graceful_shutdown_timeout_s": drain}
    ingress = rendered.deployment("Ingress")
    assert ingress["max_ongoing_requests"] == ingress_max_ongoing_requests(config)
    assert ingress["graceful_shutdown_timeout_s"] == drain


def _policy_filled_in(entry: dict[str, Any]) -> dict[str, Any]:
    """A deployment entry without its name, the policy's kwargs with its defaults filled in
    (the chart passes config.autoscaling as written; the policy fills in the rest)."""
    entry = {k: v for k, v in copy.deepcopy(entry).items() if k != "name"}
    if policy := entry.get("autoscaling_config", {}).get("policy"):
        policy["policy_kwargs"] = AutoscalingPolicyConfig(**policy["policy_kwargs"]).policy_kwargs()
    return entry


def test_default_config_serves_the_tiny_demo(render: Any) -> None:
    config = parse_config(render().config)
    assert (config.model, config.make_model, config.model_name) == ("/models/tiny", "tiny", "tiny")
    assert config.engine.device == "cpu" and config.autoscaling is None


def test_unknown_config_fields_pass_through_the_templates(render: Any) -> None:
    """The templates copy `config` whole: a field they never name still reaches build_app."""
    rendered = render({"config": {"routing_stats_period_s": 0.5, "limits": {"max_stop": 3}}})
    config = parse_config(rendered.config)
    assert (config.routing_stats_period_s, config.limits.max_stop) == (0.5, 3)


# --- the Ray cluster follows the config -------------------------------------------------


def _gpus(rendered: Rendered) -> int:
    worker = rendered.worker["template"]["spec"]["containers"][0]
    return int(worker.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


@pytest.mark.parametrize("case", list(CASES))
def test_worker_group_follows_the_config(render: Any, case: str) -> None:
    rendered = render(CASES[case])
    config = parse_config(rendered.config)  # the config the application will run
    worker = rendered.worker
    if config.autoscaling is not None:
        serve_max = config.autoscaling.max_replicas
        initial = config.autoscaling.initial_replicas or config.autoscaling.min_replicas
    else:
        serve_max = initial = config.replicas
    ceiling = CASES[case].get("worker", {}).get("maxReplicas", serve_max)
    # The group is the Ray autoscaler's (always on): from 0 to the ceiling, starting where Serve
    # starts; Serve's own bounds are in serveConfigV2 only.
    assert rendered.cluster["enableInTreeAutoscaling"] is True
    assert (worker["minReplicas"], worker["maxReplicas"], worker["replicas"]) == (
        0,
        ceiling,
        initial,
    )
    assert ceiling >= serve_max
    params = worker["rayStartParams"]
    tp = config.engine.tensor_parallel_size
    # replica_resources is per rank (a placement-group bundle): a pod holds every rank.
    assert params["num-cpus"] == str(math.ceil(config.replica_resources.num_cpus * tp))
    if config.engine.device.startswith("cuda"):
        assert _gpus(rendered) == tp and config.replica_resources.num_gpus == 1
        assert params["num-gpus"] == str(tp)
    else:
        assert _gpus(rendered) == 0 and "num-gpus" not in params
    # The head hosts no engine replica: every replica lands on a worker pod of its own.
    assert rendered.head["rayStartParams"]["num-cpus"] == "0"


def test_gpu_example_is_tp2_autoscaling_1_to_8(render: Any) -> None:
    rendered = render(example("gpu-tp2-autoscaling"))
    config = parse_config(rendered.config)
    assert config.engine.tensor_parallel_size == 2 == _gpus(rendered)
    assert config.autoscaling is not None
    assert (config.autoscaling.min_replicas, config.autoscaling.max_replicas) == (1, 8)
    assert (rendered.worker["minReplicas"], rendered.worker["maxReplicas"]) == (0, 10)
    assert rendered.cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 300
    worker = rendered.worker["template"]["spec"]
    # A label every node of a plain GKE GPU pool has (not one of GPU Feature Discovery's).
    assert worker["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert not any(k.startswith("nvidia.com/") for k in worker["nodeSelector"])
    assert worker["tolerations"][0]["key"] == "nvidia.com/gpu"
    # Only the worker asks for GPUs: not the head, not the download Job; no init container.
    assert (
        "nvidia.com/gpu"
        not in rendered.head["template"]["spec"]["containers"][0]["resources"]["limits"]
    )
    assert "initContainers" not in worker
    (job,) = rendered.kinds("Job")
    assert "nvidia.com/gpu" not in json.dumps(job)


def test_autoscaling_defaults_are_serveconfigs(render: Any) -> None:
    """`autoscaling: {}` autoscales with ServeConfig's bounds; the worker group uses the same."""
    defaults = AutoscalingSettings()
    rendered = render({"config": {"autoscaling": {}}})
    assert parse_config(rendered.config).autoscaling == defaults
    worker = rendered.worker
    assert (worker["minReplicas"], worker["maxReplicas"], worker["replicas"]) == (
        0,
        defaults.max_replicas,
        defaults.min_replicas,
    )
    rendered = render(
        {"config": {"autoscaling": {"min_replicas": 0, "max_replicas": 3, "initial_replicas": 2}}}
    )
    assert (
        rendered.worker["minReplicas"],
        rendered.worker["maxReplicas"],
        rendered.worker["replicas"],
    ) == (0, 3, 2)


def test_fractional_cpus_round_up(render: Any) -> None:
    rendered = render(
        {
            "config": {"replica_resources": {"num_cpus": 2.5}},
            "worker": {"resources": {"requests": {"cpu": "3"}}},
        }
    )
    assert rendered.worker["rayStartParams"]["num-cpus"] == "3"


def test_a_pod_holds_every_rank_of_a_replica(render: Any) -> None:
    rendered = render(
        {
            "config": {
                "replica_resources": {"num_cpus": 0.75},
                "engine": {"tensor_parallel_size": 4},
            },
            "worker": {"resources": {"requests": {"cpu": "3000m"}}},
        }
    )
    assert rendered.worker["rayStartParams"]["num-cpus"] == "3"  # 4 bundles of 0.75 CPU


def test_ray_start_params_merge_over_the_charts(render: Any) -> None:
    rendered = render(
        {
            "head": {"rayStartParams": {"num-cpus": "1", "metrics-export-port": "8080"}},
            "worker": {"rayStartParams": {"object-store-memory": "1000000000"}},
        }
    )
    assert rendered.head["rayStartParams"] == {
        "dashboard-host": "0.0.0.0",
        "num-cpus": "1",
        "metrics-export-port": "8080",
    }
    assert rendered.worker["rayStartParams"] == {
        "num-cpus": "1",
        "object-store-memory": "1000000000",
    }


def test_pod_settings_reach_both_groups(render: Any) -> None:
    tolerations = [
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    ]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["llm"]}]}
                ]
            }
        }
    }
    values = {
        "image": {
            "repository": "registry.example/pagefleet",
            "tag": "1.2.3",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "regcred"}],
        "head": {"nodeSelector": {"pool": "cpu"}, "tolerations": tolerations, "affinity": affinity},
        "worker": {
            "nodeSelector": {"pool": "llm"},
            "tolerations": tolerations,
            "affinity": affinity,
        },
        "env": [{"name": "RAY_LOG_TO_STDERR", "value": "1"}],
        "envFrom": [{"configMapRef": {"name": "extra"}}],
        "podLabels": {"team": "llm"},
        "podAnnotations": {"note": "x"},
        "serviceAccountName": "pagefleet",
    }
    rendered = render(values)
    for group, pool in ((rendered.head, "cpu"), (rendered.worker, "llm")):
        template = group["template"]
        spec = template["spec"]
        assert spec["nodeSelector"] == {"pool": pool}
        assert spec["tolerations"] == tolerations and spec["affinity"] == affinity
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["serviceAccountName"] == "pagefleet"
        assert template["metadata"]["labels"]["team"] == "llm"
        assert template["metadata"]["annotations"].items() >= {"note": "x"}.items()
        for container in _containers(group):
            assert container["image"] == "registry.example/pagefleet:1.2.3"
            assert container["imagePullPolicy"] == "Always"
        ray = spec["containers"][0]
        assert _env(ray)["RAY_LOG_TO_STDERR"] == {"name": "RAY_LOG_TO_STDERR", "value": "1"}
        assert ray["envFrom"] == [{"configMapRef": {"name": "extra"}}]


def test_image_tag_defaults_to_the_app_version(render: Any) -> None:
    version = load_yaml(CHART / "Chart.yaml")["appVersion"]
    for group in (render().head, render().worker):
        assert {c["image"] for c in _containers(group)} == {f"pagefleet:{version}"}


# --- the model: a Hub download, a PVC, the demo preset, or the image --------------------


def test_demo_preset_is_written_on_every_pod(render: Any) -> None:
    rendered = render()
    for group in (rendered.head, rendered.worker):
        spec = group["template"]["spec"]
        (init,) = spec["initContainers"]
        assert _env(init)["MAKE_MODEL"]["value"] == "tiny"
        assert _env(init)["MODEL_DIR"]["value"] == "/models/tiny"
        assert {"name": "models", "emptyDir": {}} in spec["volumes"]
        assert {"name": "models", "mountPath": "/models"} in spec["containers"][0]["volumeMounts"]


def test_make_model_init_script_writes_once_and_keeps_what_is_there(
    render: Any, tmp_path: Path
) -> None:
    """Run the init container's own script (not a copy) against a local directory."""
    (init,) = render().worker["template"]["spec"]["initContainers"]
    assert init["command"] == ["python", "-c"]
    (script,) = init["args"]
    env = {**os.environ, "MODEL_DIR": str(tmp_path / "models" / "tiny"), "MAKE_MODEL": "tiny"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    written = tmp_path / "models" / "tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in written.iterdir()
    }
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # no leftover temp dir
    # A directory with anything in it is never overwritten (a real checkpoint on a PVC).
    kept = tmp_path / "real"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    env["MODEL_DIR"] = str(kept)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "is not empty: kept as it is" in out.stdout
    assert [p.name for p in kept.iterdir()] == ["config.json"]


def test_pvc_alone_is_mounted_without_an_init_container(render: Any) -> None:
    rendered = render(
        {
            "config": {"model": "/weights/llama", "make_model": None},
            "modelSource": {
                "mountPath": "/weights",
                "pvc": {"claimName": "weights", "readOnly": True},
            },
        }
    )
    for group in (rendered.head, rendered.worker):
        spec = group["template"]["spec"]
        assert "initContainers" not in spec
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights"}} in spec[
            "volumes"
        ]
        mounts = spec["containers"][0]["volumeMounts"]
        assert {"name": "models", "mountPath": "/weights", "readOnly": True} in mounts


def test_model_in_the_image_needs_no_volume(render: Any) -> None:
    rendered = render({"config": {"model": "/opt/model", "make_model": None}})
    for group in (rendered.head, rendered.worker):
        spec = group["template"]["spec"]
        assert "initContainers" not in spec
        assert [v["name"] for v in spec["volumes"]] == ["dshm", "tmp"] + (
            ["autoscaler-api-token"] if spec is rendered.head["template"]["spec"] else []
        )


def test_shared_memory_for_the_object_store_and_nccl(render: Any) -> None:
    rendered = render({"sharedMemorySize": "8Gi"})
    for group in (rendered.head, rendered.worker):
        spec = group["template"]["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec[
            "volumes"
        ]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]


def test_api_key_comes_from_its_secret(render: Any) -> None:
    rendered = render({"apiKeySecret": {"name": "pagefleet-key", "key": "key"}})
    for group in (rendered.head, rendered.worker):
        ray = group["template"]["spec"]["containers"][0]
        assert _env(ray)["PAGEFLEET_API_KEY"] == {
            "name": "PAGEFLEET_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "pagefleet-key", "key": "key"}},
        }
    assert "Authorization: Bearer" in rendered.notes
    assert "PAGEFLEET_API_KEY" not in json.dumps(render().objects)


# --- Services, ServiceMonitor, dashboard ------------------------------------------------


def test_openai_service_is_keyed_to_the_serve_port(render: Any) -> None:
    rendered = render(
        {
            "config": {"port": 9000},
            "service": {"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"}},
        }
    )
    serve = rendered.rayservice["spec"]["serveService"]
    assert serve["metadata"]["name"] == FULLNAME
    assert serve["metadata"]["annotations"] == {"a": "b"}
    assert serve["spec"] == {
        "type": "LoadBalancer",
        "ports": [{"name": "serve", "port": 80, "targetPort": 9000, "protocol": "TCP"}],
    }
    assert rendered.serve_config["http_options"]["port"] == 9000
    for group in (rendered.head, rendered.worker):
        ports = {
            p["name"]: p["containerPort"]
            for p in group["template"]["spec"]["containers"][0]["ports"]
        }
        assert ports["serve"] == 9000  # KubeRay finds the serve port (and probes workers) by name
    assert rendered.one("Service")["spec"]["ports"][0]["port"] == 9000


def test_metrics_service_selects_the_head_pods_only(render: Any) -> None:
    rendered = render()
    service = rendered.one("Service", f"{FULLNAME}-metrics")
    selector = service["spec"]["selector"]
    head_labels = {**rendered.head["template"]["metadata"]["labels"], "ray.io/node-type": "head"}
    worker_labels = {
        **rendered.worker["template"]["metadata"]["labels"],
        "ray.io/node-type": "worker",
    }
    assert selector.items() <= head_labels.items()
    assert not selector.items() <= worker_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8000, "targetPort": "serve", "protocol": "TCP"}
    ]


def test_service_monitor_scrapes_the_metrics_service(render: Any) -> None:
    assert render().kinds("ServiceMonitor") == []
    rendered = render(
        {
            "metrics": {
                "serviceMonitor": {
                    "enabled": True,
                    "interval": "30s",
                    "labels": {"release": "prom"},
                }
            }
        }
    )
    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = rendered.one("Service", f"{FULLNAME}-metrics")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics",
        "path": "/metrics",
        "interval": "30s",
        "scrapeTimeout": "10s",
    }
    # The OpenAI Service (every proxy pod) is not what it selects: each pod serves all series.
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= (
        rendered.rayservice["spec"]["serveService"]["metadata"]["labels"].items()
    )


def test_service_monitor_authenticates_with_the_api_key_secret(render: Any) -> None:
    # With an API key, /metrics needs it (protect_metrics defaults on): the scrape sends it.
    monitor_on = {"metrics": {"serviceMonitor": {"enabled": True}}}
    keyed = {**monitor_on, "apiKeySecret": {"name": "pf-key", "key": "token"}}
    (endpoint,) = render(keyed).one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "pf-key", "key": "token"},
    }
    # No key, or /metrics opened on purpose: the scrape sends nothing.
    (endpoint,) = render(monitor_on).one("ServiceMonitor")["spec"]["endpoints"]
    assert "authorization" not in endpoint
    opened = {**keyed, "config": {"protect_metrics": False}}
    (endpoint,) = render(opened).one("ServiceMonitor")["spec"]["endpoints"]
    assert "authorization" not in endpoint


def test_grafana_dashboard_config_map(render: Any) -> None:
    assert render().kinds("ConfigMap") == []
    rendered = render({"grafana": {"dashboard": {"enabled": True, "folder": "LLM"}}})
    config_map = rendered.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    dashboard = (CHART / "dashboards" / "pagefleet.json").read_text()
    assert json.loads(config_map["data"]["pagefleet.json"]) == json.loads(dashboard)
    custom = render(
        {"grafana": {"dashboard": {"enabled": True, "label": "dash", "labelValue": "yes"}}}
    )
    assert custom.one("ConfigMap")["metadata"]["labels"]["dash"] == "yes"


def test_notes_say_how_to_reach_the_api_and_metrics(render: Any) -> None:
    notes = render(example("cpu")).notes
    assert f"port-forward svc/{FULLNAME} 8000:8000" in notes
    assert '"model": "smollm2-135m"' in notes
    assert f"http://{FULLNAME}-metrics.{NAMESPACE}.svc:8000/metrics" in notes
    assert f"get rayservice {FULLNAME}" in notes


# --- bad values fail the render, naming the field ---------------------------------------


SCHEMA_ERRORS = {
    "max_replicas not a number": (
        {"config": {"autoscaling": {"max_replicas": "eight"}}},
        "at '/config/autoscaling/max_replicas': got string, want integer",
    ),
    "negative GPUs": (
        {"config": {"replica_resources": {"num_gpus": -1}}},
        "at '/config/replica_resources/num_gpus': minimum: got -1, want 0",
    ),
    "no tensor parallel ranks": (
        {"config": {"engine": {"tensor_parallel_size": 0}}},
        "at '/config/engine/tensor_parallel_size': minimum: got 0, want 1",
    ),
    "misspelt config key": (
        {"config": {"engine": {"tensor_parallel_sise": 2}}},
        "at '/config/engine': additional properties 'tensor_parallel_sise' not allowed",
    ),
    "literal HF token": (
        {"modelSource": {"huggingFace": {"token": "hf_abcdef"}}},
        "at '/modelSource/huggingFace': additional properties 'token' not allowed",
    ),
    "HF token in place of its Secret": (
        {"modelSource": {"huggingFace": {"tokenSecret": "hf_abcdef"}}},
        "at '/modelSource/huggingFace/tokenSecret': got string, want object",
    ),
    "literal API key in the config": (
        {"config": {"api_key": "sk-abcdef"}},
        "at '/config': additional properties 'api_key' not allowed",
    ),
    "service port out of range": (
        {"service": {"port": 70000}},
        "at '/service/port': maximum: got 70,000, want 65,535",
    ),
    "rayStartParams value not a string": (
        {"worker": {"rayStartParams": {"num-cpus": 2}}},
        "at '/worker/rayStartParams/num-cpus': got number, want string",
    ),
    "bad quantity": (
        {"worker": {"resources": {"limits": {"memory": "lots"}}}},
        "at '/worker/resources/limits/memory'",
    ),
    "unknown top-level key": (
        {"replicas": 3},
        "at '': additional properties 'replicas' not allowed",
    ),
}


@pytest.mark.parametrize("case", list(SCHEMA_ERRORS))
def test_bad_values_fail_the_schema(chart: helm_python.Chart, case: str) -> None:
    values, message = SCHEMA_ERRORS[case]
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


TEMPLATE_ERRORS = {
    "GPUs per rank other than 1": (
        {
            "config": {
                "replica_resources": {"num_gpus": 2},
                "engine": {"device": "cuda", "tensor_parallel_size": 2},
            }
        },
        "config.replica_resources.num_gpus (2) must be 1 on cuda: it is per rank, and each "
        "worker pod gets config.engine.tensor_parallel_size (2) GPUs, one per rank",
    ),
    "GPUs on a CPU engine": (
        {"config": {"replica_resources": {"num_gpus": 1}}},
        "config.replica_resources.num_gpus (1) must be 0 with config.engine.device cpu",
    ),
    "no CPU for a CPU replica": (
        {"config": {"replica_resources": {"num_cpus": 0}}},
        "config.replica_resources.num_cpus must be > 0 on CPU",
    ),
    "autoscaling bounds crossed": (
        {"config": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
        "config.autoscaling.max_replicas (2) must be >= config.autoscaling.min_replicas (3)",
    ),
    "initial replicas out of bounds": (
        {"config": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5}}},
        "config.autoscaling.initial_replicas (5) must lie within [min_replicas, max_replicas] = [1, 2]",
    ),
    "literal HF token in env": (
        {"env": [{"name": "A", "value": "1"}, {"name": "HF_TOKEN", "value": "hf_abcdef"}]},
        "env[1] (HF_TOKEN): a secret must not be a literal value",
    ),
    "literal API key in env": (
        {"env": [{"name": "PAGEFLEET_API_KEY", "value": "sk-abcdef"}]},
        "env[0] (PAGEFLEET_API_KEY): a secret must not be a literal value",
    ),
    "two model sources": (
        {"modelSource": {"huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M"}}},
        "modelSource.huggingFace.repo and config.make_model both fill config.model",
    ),
    "model outside its volume": (
        {"config": {"model": "/data/tiny"}},
        "config.model (/data/tiny) must lie under modelSource.mountPath (/models)",
    ),
}


@pytest.mark.parametrize("case", list(TEMPLATE_ERRORS))
def test_inconsistent_values_fail_the_render(chart: helm_python.Chart, case: str) -> None:
    values, message = TEMPLATE_ERRORS[case]
    with pytest.raises(helm_python.HelmRenderError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


def test_no_secret_value_in_any_render(render: Any) -> None:
    """Whatever the case, the manifests hold Secret references, never a token-like literal."""
    for values in CASES.values():
        text = yaml.safe_dump_all(render(values).objects)
        assert not re.search(r"\bhf_[A-Za-z0-9]{6,}", text)
