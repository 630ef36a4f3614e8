"""A Serve config that changes only a live setting (the Ingress's `user_config`) is applied
in place: the same replica actors keep running, and the new limit answers (slow: a real
declarative deploy, as `serve deploy` does it, on a local Ray of the test's own)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.cluster.test_api import free_port

pytestmark = pytest.mark.e2e

APP = "pagefleet"


def _serve_config(model: str, http_port: int, max_n: int) -> dict[str, Any]:
    args = {
        "model": model,
        "replica_resources": {"num_cpus": 0},
        "engine": {"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 8, "num_threads": 1},
    }
    return {
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "pagefleet.cluster.app:build_app",
                "args": args,
                "deployments": [
                    {"name": "Ingress", "user_config": {"limits": {"max_n": max_n}}},
                    {"name": "EngineReplica", "num_replicas": 1},
                ],
            }
        ],
    }


def _replica_actors() -> dict[str, set[str]]:
    """The live replica actors' ids per deployment (from their names: the state API
    needs the dashboard, which this cluster leaves out)."""
    import ray

    ids: dict[str, set[str]] = {"Ingress": set(), "EngineReplica": set()}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        for deployment, found in ids.items():
            if name.startswith(f"SERVE_REPLICA::{APP}#{deployment}#"):
                actor = ray.get_actor(name, namespace=entry["namespace"])
                found.add(actor._actor_id.hex())
    return ids


def _wait_running(client: Any, deadline_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + deadline_s
    while True:
        app = serve.status().applications.get(APP)
        if app is not None and app.status == "RUNNING":
            return
        assert app is None or app.status != "DEPLOY_FAILED", app.message
        assert time.monotonic() < deadline, app
        time.sleep(1)


def test_a_limit_change_applies_in_place(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    http_port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        client = serve.context._get_global_client()
        client.deploy_apps(ServeDeploySchema.model_validate(_serve_config(llama_dir, http_port, 2)))
        _wait_running(client, 240)
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        body = {"prompt": "x", "max_tokens": 2, "n": 2}
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        before = _replica_actors()
        assert all(len(ids) == 1 for ids in before.values()), before

        # Only the Ingress's user_config changes (max_n 2 -> 1): a lightweight update.
        client.deploy_apps(ServeDeploySchema.model_validate(_serve_config(llama_dir, http_port, 1)))
        deadline = time.monotonic() + 120
        while (r := httpx.post(url, json=body, timeout=120)).status_code == 200:
            assert time.monotonic() < deadline, "the new limit never applied"
            time.sleep(0.5)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n", r.text
        one = httpx.post(url, json={**body, "n": 1}, timeout=120)
        assert one.status_code == 200, one.text
        _wait_running(client, 60)
        # The same replica actors: neither the model nor the ingress was restarted.
        assert _replica_actors() == before
    finally:
        serve.shutdown()
        ray.shutdown()
