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

from .errors import (
    EngineBrokenError,
    EngineDeadError,
    EngineOverloadedError,
    EngineStartError,
    InvalidRequestError,
    RanksOutOfStepError,
    RequestFailedError,
    StepFailedError,
)
from .output_delta import CompletionOutputDelta, RequestOutputDelta
from .outputs import CompletionOutput, RequestOutput
from .prefix_hash import DigestView, PrefixDigest, block_hashes, prefix_hash_salt, salted
from .request_metrics import RequestMetrics
from .sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from .stats import EngineStats

if TYPE_CHECKING:
    from .async_engine import Admitted, AsyncLLMEngine
    from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from .config import EngineConfig
    from .distributed import Rendezvous, open_rendezvous
    from .executor import AttachedRanks, Executor, ExecutorFactory
    from .grammar_check import ConstraintValidator
    from .grammar_spec import validate_structured_outputs
    from .llm_engine import LLM, LLMEngine
    from .workers import run_rank

# Name -> the submodule that defines it; these load torch, so they are imported lazily.
_LAZY: dict[str, str] = {
    "Admitted": "async_engine",
    "AsyncLLMEngine": "async_engine",
    "BeamSearchOutput": "beam_search",
    "BeamSearchParams": "beam_search",
    "BeamSearchSequence": "beam_search",
    "AttachedRanks": "executor",
    "EngineConfig": "config",
    "Executor": "executor",
    "ExecutorFactory": "executor",
    "LLM": "llm_engine",
    "LLMEngine": "llm_engine",
    # Tensor parallelism under an outside launcher (a Serve replica's rank actors).
    "Rendezvous": "distributed",
    "open_rendezvous": "distributed",
    "run_rank": "workers",
    # Torch-free, but it loads llguidance: only for callers that check constraints.
    "validate_structured_outputs": "grammar_spec",
    "ConstraintValidator": "grammar_check",
}

__all__ = [
    "LLM",
    "MAX_LOGPROBS",
    "Admitted",
    "AsyncLLMEngine",
    "AttachedRanks",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "CompletionOutputDelta",
    "ConstraintValidator",
    "DigestView",
    "EngineBrokenError",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStartError",
    "EngineStats",
    "Executor",
    "ExecutorFactory",
    "InvalidRequestError",
    "LLMEngine",
    "PrefixDigest",
    "RanksOutOfStepError",
    "Rendezvous",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputDelta",
    "SamplingParams",
    "StepFailedError",
    "StructuredOutputsParams",
    "block_hashes",
    "open_rendezvous",
    "prefix_hash_salt",
    "run_rank",
    "salted",
    "validate_structured_outputs",
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
