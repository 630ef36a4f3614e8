"""One replica's inference engine: paged KV cache, continuous batching, Llama-family models.

Knows nothing of Ray or HTTP; the cluster package builds on these names.
"""

from .config import EngineConfig
from .llm_engine import LLM, LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams
from .stats import EngineStats

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
