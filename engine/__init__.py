"""One replica's inference engine: paged KV cache, continuous batching, Llama-family models.

Knows nothing of Ray or HTTP; the cluster package builds on these names.
"""

from .async_engine import AsyncLLMEngine
from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .config import EngineConfig
from .executor import Executor, ExecutorFactory
from .llm_engine import LLM, LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .request_metrics import RequestMetrics
from .sampling import SamplingParams
from .stats import EngineStats

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "Executor",
    "ExecutorFactory",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
