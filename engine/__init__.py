"""One replica's inference engine: paged KV cache, continuous batching, Llama-family models.

Knows nothing of Ray or HTTP; the cluster package builds on these names.

Importing this package loads no torch. The torch-free surface (sampling
parameters, outputs, stats, request metrics, errors, prefix hashing) is
imported here; the engine itself (LLM, LLMEngine, AsyncLLMEngine, EngineConfig,
the executors, beam search) is imported on first use of its name (PEP 562), so
an ingress or a router that only validates requests and hashes prefixes never
pays for torch. `make test` holds this with import-linter (pyproject.toml).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import EngineBrokenError, RanksOutOfStepError, StepFailedError
from .outputs import CompletionOutput, RequestOutput
from .prefix_hash import DigestView, PrefixDigest, block_hashes, prefix_hash_salt
from .request_metrics import RequestMetrics
from .sampling_params import MAX_LOGPROBS, SamplingParams
from .stats import EngineStats

if TYPE_CHECKING:
    from .async_engine import Admitted, AsyncLLMEngine
    from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from .config import EngineConfig
    from .executor import Executor, ExecutorFactory
    from .llm_engine import LLM, LLMEngine

# Name -> the submodule that defines it; these load torch, so they are imported lazily.
_LAZY: dict[str, str] = {
    "Admitted": "async_engine",
    "AsyncLLMEngine": "async_engine",
    "BeamSearchOutput": "beam_search",
    "BeamSearchParams": "beam_search",
    "BeamSearchSequence": "beam_search",
    "EngineConfig": "config",
    "Executor": "executor",
    "ExecutorFactory": "executor",
    "LLM": "llm_engine",
    "LLMEngine": "llm_engine",
}

__all__ = [
    "LLM",
    "MAX_LOGPROBS",
    "Admitted",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "DigestView",
    "EngineBrokenError",
    "EngineConfig",
    "EngineStats",
    "Executor",
    "ExecutorFactory",
    "LLMEngine",
    "PrefixDigest",
    "RanksOutOfStepError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepFailedError",
    "block_hashes",
    "prefix_hash_salt",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
