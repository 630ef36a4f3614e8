"""Engine configuration: frozen, validated at construction.

Runtime findings (the number of KV blocks that fit in a memory budget, the
model's context length) are computed by the engine and returned in
`ResolvedCapacity`; they are never written back into `EngineConfig`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagefleet.settings import DTYPES, POWER_OF_TWO, Rule, check_settings, setting

from .checkpoint import (
    auto_dtype,
    check_generation_config,
    checkpoint_dir,
    checkpoint_dtype,
    cpu_has_native_bf16,
    weight_files,
)

if TYPE_CHECKING:
    import torch

# torch is imported only where a device or a dtype is resolved: a config is built and
# validated in processes that never run a model (an ingress, Serve's controller).


def resolve_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


# "shared": every rank's process sees the same GPUs; "per_rank": each sees only its own.
DEVICE_VISIBILITIES = ("shared", "per_rank")

_DEVICE = Rule(
    lambda d: isinstance(d, str) and (d in ("cpu", "cuda") or d.startswith("cuda:")),
    "'cpu' or 'cuda[:N]'",
)


@dataclass(frozen=True)
class EngineConfig:
    """What one engine replica is asked to be.

    Each field's default, range and description are declared once, here
    (`pagefleet.settings.setting`): `__post_init__` checks the ranges, and the
    serving config (`pagefleet.cluster.config.EngineSettings`) is built from
    these fields. What spans fields or depends on the machine (the checkpoint
    directory, CUDA, the GPUs visible) is checked in `__post_init__` below.

    KV capacity is given either as `num_kv_blocks` (exact, the same on every
    rank) or as `kv_cache_memory_bytes`: vLLM's meaning, the bytes for K and V
    of all layers on each tensor-parallel rank (each rank holds its share of
    the KV heads, so under TP=2 the same bytes hold twice the blocks when the
    KV heads split). With neither, on CUDA the cache takes what is left of
    `gpu_memory_utilization` of the GPU's memory after the weights and an
    activation reserve (vLLM's default sizing); on the CPU it is sized for
    `max_num_seqs` full-length sequences, at most 2 GiB per rank.

    `block_size` is any power of two in [1, 128] on both paths: the CUDA
    kernels walk keys in tiles of at least 16 positions whatever the block
    size, so tensor-core tiles do not need 16-token blocks.

    Which GPU a rank uses depends on what its process can see
    (`device_visibility`): "shared" (the standalone engine's local worker
    processes, which all see the same GPUs): with `tensor_parallel_size` N on
    CUDA, rank r uses GPU base + r, where base is N of `device="cuda:N"` (0
    for `"cuda"`). "per_rank" (Ray actors, each given one GPU through
    CUDA_VISIBLE_DEVICES): every rank uses `cuda:0`, its own GPU, so `device`
    must be "cuda" or "cuda:0".
    """

    model: str = setting(
        description="checkpoint directory (config.json and weights), or a Hugging Face Hub id"
    )
    revision: str | None = setting(
        None, "Hub revision (branch, tag or commit) of a Hub id model (default: main)"
    )
    dtype: str = setting(
        "auto",
        "weights and KV cache dtype; auto: the checkpoint's (on a CPU without native "
        "bfloat16, bfloat16 and float16 checkpoints run in float32)",
        choices=("auto", *DTYPES),
    )
    generation_config: str = setting(
        "auto",
        "request sampling defaults: auto (the checkpoint's generation_config.json), vllm "
        "(none), or a folder holding a generation_config.json",
    )
    device: str = setting(
        "cpu", "'cpu', 'cuda' or 'cuda:N' (N: rank 0's GPU, see device_visibility)", rule=_DEVICE
    )
    block_size: int = setting(
        16, "tokens per KV block (power of two, 1-128)", ge=1, le=128, rule=POWER_OF_TWO
    )
    num_kv_blocks: int | None = setting(None, "KV blocks in the pool (exact)", ge=1)
    kv_cache_memory_bytes: int | None = setting(
        None, "bytes for K and V of all layers, per rank (instead of num_kv_blocks)", gt=0
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "on CUDA without a cache size: share of GPU memory the replica may use",
        gt=0,
        le=1,
    )
    max_model_len: int | None = setting(None, "context length (default: the model's)", ge=1)
    max_num_seqs: int = setting(64, "sequences in one batch at most", ge=1)
    max_num_batched_tokens: int | None = setting(None, "token budget of one step", ge=1)
    enable_chunked_prefill: bool = setting(True, "split long prompts over steps")
    scheduling_policy: str = setting(
        "fcfs",
        "'fcfs': admit waiting requests in arrival order; 'priority': by the request's "
        "priority (lower first), then arrival, and preempt the lowest priority first",
        choices=("fcfs", "priority"),
    )
    pooling: str = setting(
        "last",
        "how an embedding request pools the final hidden states (vLLM's pooling runner): "
        "'last' token or 'mean' over the prompt; the result is L2-normalized",
        choices=("last", "mean"),
    )
    enable_prefix_caching: bool = setting(True, "reuse cached blocks of shared prefixes")
    # Why a protected share: block_manager's docstring, "Eviction".
    prefix_cache_protected_fraction: float = setting(
        0.8,
        "most of the KV pool where cached blocks a prefix hit reused outlast blocks never "
        "reused (a segmented LRU whose split adapts to the misses; 0: plain LRU)",
        ge=0,
        le=1,
    )
    seed: int = setting(0, "engine-wide random seed")
    tensor_parallel_size: int = setting(1, "ranks (GPUs) per replica", ge=1)
    num_threads: int | None = setting(None, "torch CPU threads of the engine process", ge=1)
    tokenizer: str | None = setting(None, "tokenizer path (default: the model's)")
    # Tests set PAGEFLEET_ENFORCE_EAGER=1 (tests/conftest.py): only a test about
    # compilation pays for it, by asking for enforce_eager=False.
    enforce_eager: bool | None = setting(
        None,
        "run the model eagerly: no torch.compile, no CUDA graphs (null: compiled, unless "
        "the environment sets PAGEFLEET_ENFORCE_EAGER=1)",
    )
    compile_cache_dir: str | None = setting(
        None,
        "where inductor caches compiled graphs (TORCHINDUCTOR_CACHE_DIR); a directory "
        "on a disk every node mounts lets a replica on a new node load them instead of "
        "compiling (null: $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/pagefleet/inductor)",
    )
    compile_in_background: bool = setting(
        False,
        "CPU: start serving eagerly and build the compiled forward in a background thread, "
        "switching to it between steps once it is ready (a replica serves sooner after "
        "start-up); false: compile before the first request",
    )
    # A server sets it so that a replica's queue (and so every request's wait) stays
    # bounded; the offline `LLM` leaves it unbounded and queues everything.
    max_waiting_requests: int | None = setting(
        None,
        "requests not yet scheduled once, at most; beyond it add_request raises "
        "EngineOverloadedError (null: unbounded)",
        ge=0,
    )
    # Set by whoever starts the ranks (not a user setting): see the class docstring.
    device_visibility: str = setting(
        "shared",
        "which GPUs each rank's process sees: all of them ('shared') or its own ('per_rank')",
        choices=DEVICE_VISIBILITIES,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not os.path.isfile(os.path.join(self.checkpoint, "config.json")):
            raise ValueError(
                f"model {self.model!r} is not a checkpoint directory with a config.json "
                "(write one with `pagefleet make-model DIR`)"
            )
        weight_files(self.checkpoint)
        check_generation_config(self.generation_config)
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give at most one of num_kv_blocks and kv_cache_memory_bytes")
        if self.device.startswith("cuda"):
            self._check_cuda()

    def _check_cuda(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.device_visibility == "per_rank":
            if (torch.device(self.device).index or 0) != 0:
                raise ValueError(
                    f"device {self.device!r}: each rank's process sees only its own GPU "
                    "(device_visibility 'per_rank', as under Ray), which is cuda:0; use 'cuda'"
                )
        else:
            base = torch.device(self.device).index or 0
            if base + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"device {self.device!r} with tensor_parallel_size "
                    f"{self.tensor_parallel_size} needs GPUs {base}..."
                    f"{base + self.tensor_parallel_size - 1}; {torch.cuda.device_count()} visible"
                )

    @property
    def eager(self) -> bool:
        """Whether the model runs eagerly (`enforce_eager`, or the environment's default)."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        return os.environ.get("PAGEFLEET_ENFORCE_EAGER", "0") not in ("", "0")

    @property
    def checkpoint(self) -> str:
        """The local folder of the checkpoint (a Hub id's cached snapshot)."""
        return checkpoint_dir(self.model, self.revision)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.runtime_dtype[0])

    @property
    def runtime_dtype(self) -> tuple[str, str | None]:
        """(the dtype the model runs in, why it is not the checkpoint's, or None)."""
        if self.dtype != "auto":
            return self.dtype, None
        saved = checkpoint_dtype(self.hf_config())
        return auto_dtype(saved, self.device, self.device == "cpu" and cpu_has_native_bf16())

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.checkpoint

    def hf_config(self) -> dict:
        return json.loads(Path(self.checkpoint, "config.json").read_text())


@dataclass(frozen=True)
class ResolvedCapacity:
    """What the engine worked out at start-up from the config and the model."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_bytes_per_block: int

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len-token requests fit at once (vLLM's log line)."""
        return self.num_kv_tokens / self.max_model_len
