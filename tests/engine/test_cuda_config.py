"""The CUDA path's configuration edges, checked without a GPU: KV sizing per rank and from
free GPU memory, and each tensor-parallel rank selecting its own GPU."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine import EngineConfig
from pagefleet.engine import distributed as dist_mod
from pagefleet.engine.loader import load_model
from pagefleet.engine.model_runner import (
    _GPU_OVERHEAD_BYTES,
    activation_bytes,
    gpu_kv_cache_bytes,
    resolve_capacity,
    weight_bytes_per_rank,
)
from pagefleet.engine.models import resolve_model

GiB = 1 << 30


def _args(path: str):
    return resolve_model(EngineConfig(model=path).hf_config()).args


def test_kv_cache_memory_bytes_is_per_rank(llama_dir: str) -> None:
    # tiny: 2 layers x K and V x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes per token;
    # under TP=2 each rank holds one KV head: 256 bytes per token, so twice the blocks.
    args = _args(llama_dir)
    one = resolve_capacity(EngineConfig(model=llama_dir, kv_cache_memory_bytes=512 * 16 * 10), args)
    two = resolve_capacity(
        EngineConfig(model=llama_dir, kv_cache_memory_bytes=512 * 16 * 10, tensor_parallel_size=2),
        args,
    )
    assert (one.num_kv_blocks, one.kv_bytes_per_block) == (10, 512 * 16)
    assert (two.num_kv_blocks, two.kv_bytes_per_block) == (20, 256 * 16)
    # TP=4 over 2 KV heads: each rank holds one (replicated) head, still 256 bytes per token.
    four = resolve_capacity(
        EngineConfig(model=llama_dir, kv_cache_memory_bytes=512 * 16 * 10, tensor_parallel_size=4),
        args,
    )
    assert four.num_kv_blocks == 20


def test_weight_estimate_is_the_models_parameter_bytes(llama_dir: str, qwen2_dir: str) -> None:
    for path in (llama_dir, qwen2_dir):
        model = load_model(path, torch.float32, torch.device("cpu"), 64)
        params = sum(p.numel() for p in model.parameters())  # tied weights counted once
        assert weight_bytes_per_rank(_args(path), 1, 4) == params * 4


def test_default_cuda_cache_follows_free_gpu_memory(llama_dir: str) -> None:
    args = _args(llama_dir)
    config = EngineConfig(model=llama_dir, max_model_len=256, gpu_memory_utilization=0.5)
    total, free = 80 * GiB, 79 * GiB  # 1 GiB already used on the GPU
    cap = resolve_capacity(config, args, gpu_memory=(free, total))
    weights = weight_bytes_per_rank(args, 1, 4)
    acts = activation_bytes(args, 2048, config.max_num_seqs, 4, 1)
    budget = 40 * GiB - 1 * GiB - weights - acts - _GPU_OVERHEAD_BYTES
    assert gpu_kv_cache_bytes(total, free, 0.5, weights, acts) == budget
    assert cap.num_kv_blocks == budget // (512 * 16)  # all of it, not the CPU's 2 GiB cap
    assert cap.max_model_len == 256
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        resolve_capacity(config, args, gpu_memory=(30 * GiB, total))  # 50 GiB used elsewhere


def test_gpu_memory_utilization_is_validated(llama_dir: str) -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model=llama_dir, gpu_memory_utilization=bad)


def test_rank_device() -> None:
    # Local worker processes see every GPU: rank r on base + r.
    assert dist_mod.rank_device("cuda", 0) == torch.device("cuda", 0)
    assert dist_mod.rank_device("cuda", 1) == torch.device("cuda", 1)
    assert dist_mod.rank_device("cuda:2", 1) == torch.device("cuda", 3)
    assert dist_mod.rank_device("cpu", 1) == torch.device("cpu")
    # Ray actors see only their own GPU (CUDA_VISIBLE_DEVICES): cuda:0 for every rank.
    for rank in range(4):
        assert dist_mod.rank_device("cuda", rank, "per_rank") == torch.device("cuda", 0)
    assert dist_mod.rank_device("cpu", 1, "per_rank") == torch.device("cpu")


def test_device_visibility_decides_how_many_gpus_a_process_needs(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica under Ray sees one GPU even at TP=4: it needs only that one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"needs GPUs 0...1; 1 visible"):
        EngineConfig(model=llama_dir, device="cuda", tensor_parallel_size=2)
    config = EngineConfig(
        model=llama_dir, device="cuda", tensor_parallel_size=4, device_visibility="per_rank"
    )
    assert config.device_visibility == "per_rank"
    with pytest.raises(ValueError, match=r"only its own GPU .* which is cuda:0; use 'cuda'"):
        EngineConfig(model=llama_dir, device="cuda:1", device_visibility="per_rank")
    with pytest.raises(ValueError, match="device_visibility must be one of"):
        EngineConfig(model=llama_dir, device_visibility="some")


def _fake_cuda_join(monkeypatch: pytest.MonkeyPatch, calls: list[object]) -> None:
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))

    def init_process_group(backend: str, **kw: object) -> None:
        calls.append((backend, kw["rank"], kw["world_size"], type(kw["store"]).__name__))

    monkeypatch.setattr(dist_mod.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist_mod.dist, "is_initialized", lambda: False)


def test_each_rank_selects_its_gpu_before_joining_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init_tp (rank 0 in the engine, ranks 1.. in their workers) sets the rank's GPU before NCCL,
    and joins through a client of the rendezvous store."""
    calls: list[object] = []
    _fake_cuda_join(monkeypatch, calls)
    master, rendezvous = dist_mod.open_rendezvous("127.0.0.1", 2)
    assert rendezvous.port == master.port > 0  # bound by the master, not guessed
    try:
        # Rank 0 has joined (through the secret's view of the store): rank 1 need not wait.
        dist_mod.SealedStore(master, rendezvous.secret).set("pagefleet/joined/0", b"")
        dist_mod.init_tp(1, 2, rendezvous, "cuda")
        assert calls == [("set_device", torch.device("cuda", 1)), ("nccl", 1, 2, "SealedStore")]
        calls.clear()
        dist_mod.init_tp(1, 2, rendezvous, "cuda", "per_rank")  # a Ray actor: its own GPU
        assert calls == [("set_device", torch.device("cuda", 0)), ("nccl", 1, 2, "SealedStore")]
        calls.clear()
        dist_mod.init_tp(1, 2, rendezvous, "cpu")
        assert calls == [("gloo", 1, 2, "SealedStore")]  # the CPU path touches no CUDA device
    finally:
        dist_mod.destroy_tp()


def test_a_rank_waits_for_the_others_on_the_store_and_gives_up_when_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 waiting for a rank that is gone stops as soon as its executor says so."""
    calls: list[object] = []
    _fake_cuda_join(monkeypatch, calls)
    master, rendezvous = dist_mod.open_rendezvous("127.0.0.1", 3)
    reasons = iter([None, None, "rank 2 exited"])
    with pytest.raises(RuntimeError, match=r"^tensor-parallel ranks joined: rank 2 exited$"):
        dist_mod.init_tp(0, 3, rendezvous, "cpu", failed=lambda: next(reasons))
    assert calls == []  # never reached the process group
    sealed = dist_mod.SealedStore(master, rendezvous.secret)
    assert sealed.check(["pagefleet/joined/0"])  # rank 0 marked itself joined
    assert not sealed.check(["pagefleet/joined/1"])
