"""The soak benchmark's pure helpers: process roles, fits, percentiles, the metrics page."""

from __future__ import annotations

import math
import random

from pagefleet.cluster.bench.soak import (
    ProcSample,
    Sample,
    leaked_blocks,
    make_plan,
    parse_replicas,
    percentile,
    process_role,
    rss_growth,
    slope,
)

VENV = "/work/.venv/lib/python3.11/site-packages/ray"


def test_roles_from_the_command_lines_ray_and_serve_give_their_processes() -> None:
    def role(cmd: str, parent: str | None = "pagefleet serve") -> str:
        return process_role(cmd.split(), cmd.split()[0].rsplit("/", 1)[-1], parent)

    assert role("/venv/bin/python -m pagefleet.cluster.cli serve x.yaml", None) == "pagefleet serve"
    assert role(f"{VENV}/core/src/ray/gcs/gcs_server --log_dir=/tmp") == "ray gcs"
    assert role(f"{VENV}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x") == "ray raylet"
    assert role("ray::ServeController") == "serve controller"
    assert role("ray::ProxyActor") == "serve proxy"
    # Ray retitles an actor's process with the method it is running.
    assert role("ray::ServeReplica:pagefleet:EngineReplica", "ray raylet") == "engine replica"
    assert (
        role("ray::ServeReplica:pagefleet:EngineReplica.handle_request_with_rejection")
        == "engine replica"
    )
    assert role("ray::ServeReplica:pagefleet:Ingress.check_health") == "ingress"
    assert role("ray::ServeReplica:pagefleet:MetricsHubDeployment") == "metrics hub"
    assert role("ray::ServeReplica:other:Thing.run") == "serve replica Thing"
    assert role(f"/venv/bin/python {VENV}/dashboard/dashboard.py --host=x") == "ray support"
    assert role("ray::DashboardAgent") == "ray support"
    assert role("ray::IDLE") == "ray idle worker"
    spawn = "/venv/bin/python -B -c from multiprocessing.spawn import spawn_main; spawn_main()"
    assert role(spawn, "engine replica") == "engine core"
    assert role(spawn, "engine core") == "engine TP rank"
    tracker = "/venv/bin/python -B -c from multiprocessing.resource_tracker import main;main(63)"
    assert role(tracker, "engine replica") == "mp resource tracker"
    assert role("ray::RayWorker.run", "ray raylet") == "ray actor RayWorker.run"


def test_percentile_is_nearest_rank() -> None:
    assert math.isnan(percentile([], 0.99))
    values = list(range(1, 101))
    assert percentile(values, 0.99) == 99
    assert percentile(values, 0.5) == 50
    assert percentile(values, 1.0) == 100
    assert percentile([3.0], 0.99) == 3.0


def test_slope_is_least_squares_and_nan_without_enough_points() -> None:
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2
    assert math.isnan(slope([0, 1], [0, 1]))
    assert math.isnan(slope([5, 5, 5], [1, 2, 3]))


def _sample(t: float, finished: int, procs: list[tuple[int, str, float]]) -> Sample:
    return Sample(t, finished, [ProcSample(*p) for p in procs], {}, None)


def test_rss_growth_fits_each_process_and_ignores_the_warm_up() -> None:
    samples = [
        # warm-up: the replica grows fast while it loads (not counted)
        _sample(0, 0, [(1, "engine replica", 100), (2, "ingress", 50)]),
        _sample(10, 1000, [(1, "engine replica", 400), (2, "ingress", 50)]),
        # after it: the replica grows 1 MiB per 1,000 requests, the ingress is flat
        _sample(20, 2000, [(1, "engine replica", 400), (2, "ingress", 50)]),
        _sample(30, 3000, [(1, "engine replica", 401), (2, "ingress", 50)]),
        _sample(40, 4000, [(1, "engine replica", 402), (2, "ingress", 50), (3, "ingress", 70)]),
        _sample(50, 5000, [(1, "engine replica", 403), (3, "ingress", 70)]),
        _sample(60, 6000, [(1, "engine replica", 404), (3, "ingress", 70)]),
    ]
    growth = {g.role: g for g in rss_growth(samples, warmup_s=20)}
    replica = growth["engine replica"]
    assert math.isclose(replica.per_1k, 1.0)
    assert (replica.rss_start, replica.rss_end, replica.processes, replica.churn) == (
        400,
        404,
        1,
        0,
    )
    # A process that replaced another is not growth: each is fitted on its own (both flat).
    ingress = growth["ingress"]
    assert math.isclose(ingress.per_1k, 0.0, abs_tol=1e-9)
    assert (ingress.rss_start, ingress.rss_end, ingress.processes, ingress.churn) == (
        50,
        70,
        1,
        2,
    )


METRICS = """\
# TYPE pagefleet:kv_blocks_free gauge
pagefleet:kv_blocks_free{model_name="tiny",replica="a"} 512.0
pagefleet:kv_blocks_free{model_name="tiny",replica="b"} 500.0
# TYPE pagefleet:kv_blocks_total gauge
pagefleet:kv_blocks_total{model_name="tiny",replica="a"} 512.0
pagefleet:kv_blocks_total{model_name="tiny",replica="b"} 512.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny",replica="b"} 1.0
# TYPE pagefleet:replicas gauge
pagefleet:replicas{model_name="tiny"} 2.0
"""


def test_parse_replicas_and_leaked_blocks() -> None:
    replicas, fleet = parse_replicas(METRICS)
    assert fleet == 2
    assert set(replicas) == {"a", "b"}
    assert (replicas["b"].free, replicas["b"].total, replicas["b"].running) == (500, 512, 1)
    assert leaked_blocks(replicas) == 12


def test_the_plan_sequence_is_fixed_by_the_seed() -> None:
    a = [make_plan(random.Random(7), 0.1, 0.05) for _ in range(3)]
    b = [make_plan(random.Random(7), 0.1, 0.05) for _ in range(3)]
    assert a == b
    plans = [make_plan(r, 0.1, 0.05) for r in [random.Random(1)] for _ in range(4000)]
    actions = {k: sum(p.action == k for p in plans) / len(plans) for k in ("cancel", "disconnect")}
    assert 0.05 < actions["cancel"] < 0.09  # 10 % of the 70 % streamed
    assert 0.06 < actions["disconnect"] < 0.11  # 5 % + the 3 % non-streamed cancels
    assert all(p.after >= 1 for p in plans if p.action == "cancel")
