"""`serve deploy` of configs/serve-example.yaml on a two-node Ray cluster (Ray's own
`ray.cluster_utils.Cluster`: two raylets on this machine), as on a real cluster: the
replicas land on both nodes and the OpenAI endpoint answers, under a route prefix and
behind the API key (Serve keeps the prefix in the path: every keyed route must still
ask for the key). Then a second `serve deploy` that changes only a live setting (the
Ingress's `user_config`) is applied in place: the same replica actors keep running and
the new limit answers (on the same cluster: one start-up for both)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import yaml

from tests.cluster.http.test_api import free_port
from tests.e2e.served import assert_none_left_since, children_now

if TYPE_CHECKING:
    from ray.util.state.common import ActorState

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/llm"
KEY = "sk-multinode-7d1e"


def serve_cli() -> str:
    cli = Path(sys.executable).with_name("serve")
    return str(cli) if cli.exists() else shutil.which("serve") or "serve"


def alive_replicas(deployment: str) -> list[ActorState]:
    """The live replica actors of one of pagefleet's deployments (Ray's state API)."""
    from ray.util.state import list_actors

    return list_actors(
        filters=[
            ("class_name", "=", f"ServeReplica:pagefleet:{deployment}"),
            ("state", "=", "ALIVE"),
        ]
    )


def replica_actors() -> dict[str, set[str]]:
    """The live replica actors' ids per deployment."""
    return {d: {a.actor_id for a in alive_replicas(d)} for d in ("Ingress", "EngineReplica")}


def test_serve_deploy_places_replicas_on_both_nodes_and_applies_a_limit_in_place(
    llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dashboard_port, http_port = free_port(), free_port()
    before = children_now()
    # One CPU per node and one per engine replica: the two replicas need both nodes.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_port": dashboard_port,
        },
    )
    cluster.add_node(num_cpus=1)
    try:
        config = yaml.safe_load((REPO / "configs" / "serve-example.yaml").read_text())
        # This machine runs both nodes: one proxy (two would share the port), our model.
        config["proxy_location"] = "HeadOnly"
        config["http_options"] = {"host": "127.0.0.1", "port": http_port}
        config["applications"][0]["route_prefix"] = PREFIX
        args = config["applications"][0]["args"]
        args.update(model=llama_dir, make_model=None, api_key=KEY)
        args["engine"].update(num_kv_blocks=64, block_size=8, max_num_seqs=8, num_threads=1)
        assert args["replicas"] == 2 and args["replica_resources"]["num_cpus"] == 1
        serve_yaml = tmp_path / "serve.yaml"
        serve_yaml.write_text(yaml.safe_dump(config))
        address = f"http://127.0.0.1:{dashboard_port}"
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        deadline = time.monotonic() + 60
        while (
            r := subprocess.run(
                [serve_cli(), "deploy", str(serve_yaml), "--address", address],
                capture_output=True,
                text=True,
                env=env,
            )
        ).returncode != 0:  # the dashboard's REST API comes up a little after the head
            assert time.monotonic() < deadline, r.stderr
            time.sleep(2)

        url = f"http://127.0.0.1:{http_port}{PREFIX}"
        auth = {"Authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/v1/models", headers=auth, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the application did not come up"
            time.sleep(1)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for method, path, body in (
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
            ("POST", "/v1/chat/completions", chat),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [5]}),
            ("GET", "/dashboard/data", None),
        ):
            bare = httpx.request(method, url + path, json=body, timeout=60)
            assert bare.status_code == 401, (path, bare.status_code, bare.text)
            keyed = httpx.request(method, url + path, json=body, headers=auth, timeout=120)
            assert keyed.status_code == 200, (path, keyed.status_code, keyed.text)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open
        for i in range(4):
            body = {
                "model": "tiny",
                "prompt": f"node test {i}",
                "max_tokens": 5,
                "ignore_eos": True,
            }
            r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5

        ray.init(address=cluster.address, log_to_driver=False)
        replicas = alive_replicas("EngineReplica")
        nodes = {a.node_id for a in replicas}
        assert len(replicas) == 2 and nodes == {n.node_id for n in cluster.list_all_nodes()}

        # Only the Ingress's user_config changes (max_n 8 -> 1): Serve reconfigures the
        # running replicas, restarting neither the models nor the ingress.
        before = replica_actors()
        n2 = {"prompt": "x", "max_tokens": 2, "n": 2}
        assert httpx.post(f"{url}/v1/completions", json=n2, headers=auth, timeout=120).is_success
        config["applications"][0]["deployments"] = [
            {"name": "Ingress", "user_config": {"limits": {"max_n": 1}}}
        ]
        serve_yaml.write_text(yaml.safe_dump(config))
        subprocess.run(
            [serve_cli(), "deploy", str(serve_yaml), "--address", address],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        deadline = time.monotonic() + 120
        while (
            r := httpx.post(f"{url}/v1/completions", json=n2, headers=auth, timeout=120)
        ).is_success:
            assert time.monotonic() < deadline, "the new limit never applied"
            time.sleep(0.5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        one = httpx.post(f"{url}/v1/completions", json={**n2, "n": 1}, headers=auth, timeout=120)
        assert one.status_code == 200, one.text
        assert replica_actors() == before
        subprocess.run(
            [serve_cli(), "shutdown", "-y", "--address", address], env=env, check=True, timeout=120
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    # Nothing of the cluster outlives it.
    assert_none_left_since(before, 30)
