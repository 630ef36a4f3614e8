"""Tensor-parallel replicas in the config: one placement-group bundle per rank, resources per
rank validated with the field to change, the engine told that each rank sees only its GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.cluster.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def cfg(**kw: object) -> dict:
    return {"model": "m", **kw}


def test_a_tp_replica_is_one_bundle_per_rank() -> None:
    cpu = parse_config(cfg(replica_resources={"num_cpus": 0.5}, engine={"tensor_parallel_size": 2}))
    assert cpu.replica_bundles() == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert cpu.placement() == {
        "placement_group_bundles": [{"CPU": 0.5}, {"CPU": 0.5}],
        "placement_group_strategy": "STRICT_PACK",
    }
    gpu = parse_config(
        cfg(
            replica_resources={"num_cpus": 2, "num_gpus": 1, "placement_group_strategy": "PACK"},
            engine={"device": "cuda", "tensor_parallel_size": 4},
        )
    )
    assert gpu.replica_bundles() == [{"CPU": 2.0, "GPU": 1.0}] * 4
    assert gpu.placement()["placement_group_strategy"] == "PACK"
    # No CPU asked for: the bundle is the GPU alone (Ray refuses zero-valued bundles).
    bare = parse_config(
        cfg(
            replica_resources={"num_cpus": 0, "num_gpus": 1},
            engine={"device": "cuda", "tensor_parallel_size": 2},
        )
    )
    assert bare.replica_bundles() == [{"GPU": 1.0}, {"GPU": 1.0}]


def test_one_rank_needs_no_placement_group() -> None:
    one = parse_config(cfg(replica_resources={"num_cpus": 0.5}))
    assert one.replica_bundles() is None and one.placement() == {}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            cfg(
                replica_resources={"num_gpus": 2},
                engine={"device": "cuda", "tensor_parallel_size": 2},
            ),
            "replica_resources.num_gpus (2) must be 1 with engine.tensor_parallel_size 2: it is "
            "per rank, and each rank of a replica holds one whole GPU",
        ),
        (
            cfg(replica_resources={"num_gpus": 0}, engine={"device": "cuda"}),
            "replica_resources.num_gpus must be > 0 with engine.device cuda",
        ),
        (
            cfg(replica_resources={"num_gpus": 1}),
            "replica_resources.num_gpus (1) must be 0 with engine.device cpu",
        ),
        (
            cfg(replica_resources={"num_cpus": 0}, engine={"tensor_parallel_size": 2}),
            "replica_resources.num_cpus must be > 0 with engine.tensor_parallel_size 2 on CPU",
        ),
        (
            cfg(replica_resources={"num_gpus": 1}, engine={"device": "cuda:1"}),
            "engine.device 'cuda:1': under Ray each rank sees only the GPU Ray gives it, as "
            "cuda:0; use device: cuda",
        ),
        (
            cfg(replica_resources={"placement_group_strategy": "SPREAD_OUT"}),
            "replica_resources.placement_group_strategy: Input should be 'STRICT_PACK', "
            "'PACK', 'SPREAD' or 'STRICT_SPREAD'",
        ),
    ],
)
def test_resources_that_cannot_hold_the_ranks_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert message in str(err.value)


def test_replicas_run_every_rank_on_the_gpu_ray_gives_it(llama_dir: str) -> None:
    config = parse_config({"model": llama_dir, "engine": {"tensor_parallel_size": 2}})
    engine = config.engine_config()
    assert (engine.tensor_parallel_size, engine.device_visibility) == (2, "per_rank")


def test_build_app_deploys_the_engine_with_its_bundles(llama_dir: str) -> None:
    from pagefleet.cluster.app import build_app

    app = build_app(
        {
            "model": llama_dir,
            "replica_resources": {"num_cpus": 0.5},
            "engine": {"tensor_parallel_size": 2},
        }
    )
    ingress = app._bound_deployment
    (engine,) = [
        a._bound_deployment
        for a in ingress.init_args
        if getattr(getattr(a, "_bound_deployment", None), "name", None) == "EngineReplica"
    ]
    replica = engine._replica_config
    assert replica.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert replica.placement_group_strategy == "STRICT_PACK"
    # The replica actor asks for bundle 0's resources exactly (Serve pins it there).
    assert replica.ray_actor_options["num_cpus"] == 0.5
    assert replica.ray_actor_options["num_gpus"] == 0.0


def test_the_gpu_example_is_tp2_autoscaling_1_to_8() -> None:
    config = load_config(REPO / "configs" / "gpu-tp2.yaml")
    assert (config.engine.device, config.engine.tensor_parallel_size) == ("cuda", 2)
    assert config.autoscaling is not None
    assert (config.autoscaling.min_replicas, config.autoscaling.max_replicas) == (1, 8)
    assert config.placement() == {
        "placement_group_bundles": [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}],
        "placement_group_strategy": "STRICT_PACK",
    }
