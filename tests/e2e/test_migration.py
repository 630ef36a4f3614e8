"""Mid-stream migration on real Ray Serve (docs/migration.md), through the official
`openai` client: two engine replicas, 16 streams (8 greedy, 8 seeded; a JSON-schema
constraint, n=2 and logprobs among them). One replica is killed (`ray.kill` of its
actor) while they run; later one is scaled in (`serve deploy` of the same application
with `num_replicas: 1`, applied in place). Every stream completes with no error event
and is, choice by choice, token for token what the same request produced without
either; the moves show in `pagefleet:migrated_requests_total`.

A replica runs at most 4 sequences at once, so while the first ones stream, the others
wait on it admitted: a kill moves both (a continuation for the running, the request
whole for the waiting). Routing is round robin, so each replica gets half of the 16
whatever it caches, and the scale-in waits until the router offers the replica that
replaced the killed one. The figures it prints are in docs/migration.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.http.test_api import free_port
from tests.e2e.served import assert_none_left_since, children_now
from tests.engine.test_continuation import SCHEMA

pytestmark = pytest.mark.e2e

# Long enough that the kill lands while the second wave of each replica still streams (at
# 48, on an idle 2-core host, all 16 had ended before the kill reached the replica).
KILL_TOKENS = 160
# Long enough to outlast the deploy's way to the controller and the short drain (at 160,
# on a 2-core host, the streams had ended before the replica was told to stop).
SCALE_IN_TOKENS = 800
DRAIN_S = 1.0


@dataclass
class Fleet:
    url: str
    dashboard: str
    config: dict[str, Any]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def deploy(self, engine_replicas: int | None = None) -> None:
        """Serve's REST deploy (what `serve deploy` sends), optionally with the engine's
        num_replicas overridden (applied in place, as a scale)."""
        config = dict(self.config)
        app = dict(config["applications"][0])
        if engine_replicas is not None:
            app["deployments"] = [{"name": "EngineReplica", "num_replicas": engine_replicas}]
        config["applications"] = [app]
        r = httpx.put(f"{self.dashboard}/api/serve/applications/", json=config, timeout=60)
        r.raise_for_status()

    def counters(self, name: str, label: str) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name:
                    out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


def engine_actors(fleet: Fleet) -> list[Any]:
    """The live engine replica actors (Ray's state API of this cluster, by its address:
    other Ray clusters may run on the machine)."""
    from ray.util.state import list_actors

    return list_actors(
        address=fleet.dashboard,
        filters=[
            ("class_name", "=", "ServeReplica:pagefleet:EngineReplica"),
            ("state", "=", "ALIVE"),
        ],
    )


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)
    before = children_now()
    dashboard_port, http_port = free_port(), free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": True, "dashboard_port": dashboard_port},
    )
    args = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "replicas": 2,
        "replica_resources": {"num_cpus": 0.5},
        # Each replica gets half of the 16 whatever it caches (the prefix-aware policy
        # would send every repeat of a prompt to the replica that ran it first).
        "routing": "round_robin",
        "migration_drain_s": DRAIN_S,
        "engine": {
            "dtype": "float32",
            "block_size": 16,
            "num_kv_blocks": 256,
            "max_num_seqs": 4,
            "num_threads": 1,
        },
    }
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": "pagefleet",
                "route_prefix": "/",
                "import_path": "pagefleet.cluster.app:build_app",
                "args": args,
            }
        ],
    }
    f = Fleet(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{dashboard_port}", config)
    try:
        deadline = time.monotonic() + 60
        while True:  # the dashboard's REST API comes up a little after the head
            try:
                f.deploy()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(2)

        def up() -> bool:
            try:
                return httpx.get(f"{f.url}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("the application did not come up", up)
        ray.init(address=cluster.address, log_to_driver=False)
        wait_for("two engine replicas", lambda: running_replicas() == 2)
        yield f
        httpx.delete(f"{f.dashboard}/api/serve/applications/", timeout=120)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert_none_left_since(before, 60)


# -- the 16 streams ------------------------------------------------------------------


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Run:
    """One stream as the client saw it: each choice, and when each chunk with tokens
    came."""

    choices: dict[int, Choice] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())


def spec(i: int, max_tokens: int) -> dict[str, Any]:
    """Request i: 0-7 greedy, 8-15 seeded; by i % 4 a JSON schema (chat), n=2, logprobs,
    or plain."""
    sampling: dict[str, Any] = (
        {"temperature": 0.0} if i < 8 else {"temperature": 1.0, "top_p": 0.9, "seed": 100 + i}
    )
    kind = i % 4
    if kind == 0:
        return {
            "chat": True,
            "messages": [{"role": "user", "content": f"record number {i}"}],
            "max_tokens": max_tokens,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "record", "schema": SCHEMA},
            },
            **sampling,
        }
    extra = {"n": 2} if kind == 1 else {"logprobs": 2} if kind == 2 else {}
    return {"prompt": f"stream {i} goes on and on", "max_tokens": max_tokens, **sampling, **extra}


def stream_one(fleet: Fleet, request: dict[str, Any], run: Run) -> None:
    body = dict(request)
    chat = body.pop("chat", False)
    client = fleet.client()
    extra = {"return_token_ids": True} | ({} if chat else {"ignore_eos": True})
    try:
        if chat:
            chunks = client.chat.completions.create(
                model="tiny", stream=True, extra_body=extra, **body
            )
        else:
            chunks = client.completions.create(model="tiny", stream=True, extra_body=extra, **body)
        for chunk in chunks:
            for c in chunk.choices:
                choice = run.choices.setdefault(c.index, Choice())
                ids = (c.model_extra or {}).get("token_ids") or []
                choice.token_ids += ids
                if ids:
                    run.times.append(time.monotonic())
                if chat:
                    choice.text += c.delta.content or ""
                else:
                    choice.text += c.text
                    if c.logprobs is not None:
                        choice.logprobs += list(c.logprobs.token_logprobs or [])
                choice.finish_reason = c.finish_reason or choice.finish_reason
    except BaseException as e:  # an error event raises here: the test reports it
        run.error = e


def start(fleet: Fleet, max_tokens: int) -> tuple[list[Run], list[threading.Thread]]:
    runs = [Run() for _ in range(16)]
    threads = [
        threading.Thread(target=stream_one, args=(fleet, spec(i, max_tokens), runs[i]))
        for i in range(16)
    ]
    for t in threads:
        t.start()
    return runs, threads


def finish(runs: list[Run], threads: list[threading.Thread]) -> list[Run]:
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert [r.error for r in runs] == [None] * 16
    return runs


def mid_stream(runs: list[Run]) -> bool:
    """Some streams are under way (4 tokens in)."""
    return len([r for r in runs if r.tokens >= 4]) >= 4


def check_equal(got: list[Run], want: list[Run]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert sorted(g.choices) == sorted(w.choices) == list(range(2 if i % 4 == 1 else 1))
        for k, c in w.choices.items():
            h = g.choices[k]
            assert h.token_ids == c.token_ids and len(c.token_ids) > 0, (i, k)
            assert (h.text, h.finish_reason) == (c.text, c.finish_reason), (i, k)
            assert h.logprobs == pytest.approx(c.logprobs, abs=1e-3), (i, k)
        if i % 4 == 2:
            assert len(w.choices[0].logprobs) == len(w.choices[0].token_ids)


def longest_stall(runs: list[Run]) -> float:
    """The longest a client waited between two tokens of its stream."""
    return max(b - a for r in runs for a, b in zip(r.times, r.times[1:], strict=False))


def routes_to_both(fleet: Fleet) -> bool:
    """Two short requests, one to each replica (round robin): the router offers both."""
    before = fleet.counters("pagefleet:routed_requests_total", "replica")
    for i in range(2):
        fleet.client().completions.create(model="tiny", prompt=f"probe {i}", max_tokens=1)
    after = fleet.counters("pagefleet:routed_requests_total", "replica")
    return len([k for k, v in after.items() if v > before.get(k, 0.0)]) == 2


def running_replicas() -> int:
    """The engine replicas Serve's controller has running (routers offer them)."""
    from ray import serve

    app = serve.status().applications["pagefleet"]
    return app.deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def test_streams_survive_a_killed_replica_and_a_scale_in(fleet: Fleet) -> None:
    import ray

    t0 = time.monotonic()
    reference = {n: finish(*start(fleet, n)) for n in (KILL_TOKENS, SCALE_IN_TOKENS)}
    print(f"the two reference runs took {time.monotonic() - t0:.1f} s")
    assert all(r.tokens for rs in reference.values() for r in rs)
    migrated_before = fleet.counters("pagefleet:migrated_requests_total", "reason")

    # A replica killed mid-stream: the one that took the most of the 16. Its handle is
    # looked up before the streams start, so the kill follows the choice at once.
    handles = {a.name: ray.get_actor(a.name, namespace="serve") for a in engine_actors(fleet)}
    routed_before = fleet.counters("pagefleet:routed_requests_total", "replica")
    runs, threads = start(fleet, KILL_TOKENS)
    wait_for("streams under way", lambda: mid_stream(runs), 120)
    routed = fleet.counters("pagefleet:routed_requests_total", "replica")
    by_replica = {k: v - routed_before.get(k, 0.0) for k, v in routed.items()}
    victim = max(by_replica, key=lambda k: by_replica[k])
    (handle,) = [h for name, h in handles.items() if name.endswith(victim)]
    ray.kill(handle, no_restart=True)
    check_equal(finish(runs, threads), reference[KILL_TOKENS])
    migrated = fleet.counters("pagefleet:migrated_requests_total", "reason")
    moved = sum(migrated.get(k, 0.0) - migrated_before.get(k, 0.0) for k in migrated)
    assert moved >= 1, (by_replica, migrated)
    assert migrated.get("scale_in", 0.0) == migrated_before.get("scale_in", 0.0)
    print(  # the figures docs/migration.md reports
        f"kill: {by_replica[victim]:g} of 16 on the killed replica, {moved:g} moved, "
        f"longest stall {longest_stall(runs):.2f} s "
        f"(uninterrupted: {longest_stall(reference[KILL_TOKENS]):.2f} s)"
    )

    # Serve replaces it; then a scale-in to one replica while 16 streams run.
    wait_for("the killed replica replaced", lambda: running_replicas() == 2)
    wait_for("the router offers the new replica", lambda: routes_to_both(fleet))
    ids_before = {a.actor_id for a in engine_actors(fleet)}
    routed_before = fleet.counters("pagefleet:routed_requests_total", "replica")
    runs, threads = start(fleet, SCALE_IN_TOKENS)
    wait_for("streams under way", lambda: mid_stream(runs), 120)
    routed = fleet.counters("pagefleet:routed_requests_total", "replica")
    by_replica = {k: v - routed_before.get(k, 0.0) for k, v in routed.items()}
    assert len([n for n in by_replica.values() if n]) == 2, by_replica  # both have some
    scaled_at = time.monotonic()
    fleet.deploy(engine_replicas=1)
    wait_for("one engine replica left", lambda: len(engine_actors(fleet)) == 1, 120)
    stopped_s = time.monotonic() - scaled_at
    check_equal(finish(runs, threads), reference[SCALE_IN_TOKENS])
    after = fleet.counters("pagefleet:migrated_requests_total", "reason")
    assert after["scale_in"] - migrated.get("scale_in", 0.0) >= 1, after
    assert {a.actor_id for a in engine_actors(fleet)} < ids_before  # stopped, not replaced
    # Within the short drain, not request_timeout_s (600 s): a loose bound, not a speed.
    assert stopped_s < 120, stopped_s
    print(
        f"scale-in: replica stopped {stopped_s:.1f} s after the deploy "
        f"(migration_drain_s {DRAIN_S:g}), {after['scale_in'] - migrated.get('scale_in', 0):g} "
        f"moved, longest stall {longest_stall(runs):.2f} s "
        f"(uninterrupted: {longest_stall(reference[SCALE_IN_TOKENS]):.2f} s)"
    )

    def balanced() -> bool:  # block accounting: every block back once the streams ended
        free = fleet.counters("pagefleet:kv_blocks_free", "replica")
        total = fleet.counters("pagefleet:kv_blocks_total", "replica")
        return len(total) == 1 and free == total

    wait_for("every block free on the replica left", balanced, 120)
