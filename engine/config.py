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

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


# "shared": every rank's process sees the same GPUs; "per_rank": each sees only its own.
DEVICE_VISIBILITIES = ("shared", "per_rank")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine replica is asked to be.

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

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    num_threads: int | None = None
    tokenizer: str | None = None
    # Admission bound: requests not yet scheduled once. A server sets it so that a
    # replica's queue (and so every request's wait) stays bounded; beyond it add_request
    # raises EngineOverloadedError. None: unbounded (the offline `LLM` queues everything).
    max_waiting_requests: int | None = None
    # Set by whoever starts the ranks (not a user setting): see the class docstring.
    device_visibility: str = "shared"

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        if not os.path.isdir(self.model) or not os.path.isfile(
            os.path.join(self.model, "config.json")
        ):
            raise ValueError(
                f"model {self.model!r} is not a checkpoint directory with a config.json "
                "(write one with `pagefleet make-model DIR`)"
            )
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two in [1, 128], got {self.block_size}"
            )
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give at most one of num_kv_blocks and kv_cache_memory_bytes")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device_visibility not in DEVICE_VISIBILITIES:
            raise ValueError(
                f"device_visibility must be one of {DEVICE_VISIBILITIES}, "
                f"got {self.device_visibility!r}"
            )
        if self.device_visibility == "per_rank" and self.device.startswith("cuda"):
            if (torch.device(self.device).index or 0) != 0:
                raise ValueError(
                    f"device {self.device!r}: each rank's process sees only its own GPU "
                    "(device_visibility 'per_rank', as under Ray), which is cuda:0; use 'cuda'"
                )
        elif self.device.startswith("cuda"):
            base = torch.device(self.device).index or 0
            if base + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"device {self.device!r} with tensor_parallel_size "
                    f"{self.tensor_parallel_size} needs GPUs {base}..."
                    f"{base + self.tensor_parallel_size - 1}; {torch.cuda.device_count()} visible"
                )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def hf_config(self) -> dict:
        return json.loads(Path(self.model, "config.json").read_text())


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
