"""The model's forward under `torch.compile` (inductor), compiled at start-up.

What is compiled: the whole decoder stack, embedding to final norm, as one
graph. Attention and the CPU's pre-packed GEMMs are custom ops the graph calls
(`pagefleet/engine/custom_ops.py`), so the graph does not depend on the step's layout:
only on the number of tokens. Between those calls inductor fuses the
elementwise work of each layer (the residual add with the RMSNorm that
follows it, SiLU-and-mul, the rotary table lookup and rotation of queries and
keys together) into generated kernels, and the step runs without the
per-operator Python dispatch of the eager model.

Shapes: the token count is a dynamic dimension, traced size-oblivious (a
size of 1, a single decoding sequence, is not specialised), so one graph
serves every step from 1 token to the step's token budget, with no padding.
`warm_up` compiles it before the engine takes its first request, running
sizes 1 and 2 (the second checks that the graph is reused), and the sizes
the scheduler makes after that never compile again
(tests/engine/test_oracle.py asserts it). Bucketed static sizes with padding
were measured against this on the CPU (benchmarks/compile_shapes.py,
BENCHMARKS.md): a static graph is no faster, and padding costs whole rows of
GEMMs.

Guards: before each call Dynamo checks the guards recorded when the graph was
traced. Thousands of them are on the model itself (each module's type, its empty
hook dicts, its constant attributes), which does not change once loaded: checking
them every step is pure overhead, so only the guards on the inputs and on the
global state are kept (`keeps_guard`).

Cache: inductor keeps compiled graphs on disk (`TORCHINDUCTOR_CACHE_DIR`,
which `configure_inductor_cache` points at the engine's `compile_cache_dir`,
else at `~/.cache/pagefleet/inductor` unless it is set), and the graphs of one
model shape are the same in every process, so a second start-up of the same
model skips code generation and the C++ compiler and only re-traces. A cache
directory on a disk every node mounts serves a replica started on a new node.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from . import custom_ops  # noqa: F401  (registers pagefleet::attention, ::packed_linear)
from .layers.attention import ForwardContext, forward_context

logger = logging.getLogger("pagefleet.engine")

# The token counts warm-up runs: the first compiles the one graph, the second reuses it.
WARM_UP_SIZES = (1, 2)


def configure_inductor_cache(cache_dir: str | None = None) -> str:
    """The directory inductor caches compiled graphs in (set for this process):
    `cache_dir` if given, else `TORCHINDUCTOR_CACHE_DIR`, else the user's cache."""
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    default = Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "pagefleet", "inductor"
    )
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default))


def trace_inductors_helper_now() -> None:
    """Make, in this thread, the one graph inductor's CPU code generation traces with
    `torch.fx.symbolic_trace` (an identity graph it caches for the process).

    A symbolic trace patches `torch.nn.Module.__call__` for the whole process while it
    runs, so an eager step on another thread at that moment fails ("module is not
    installed as a submodule"). A compile in the background (`compile_in_background`)
    calls this before it starts: its own traces are then `make_fx`'s, whose patched
    module calls run the module as they would unpatched."""
    from torch._inductor.loop_body import InterpreterShim

    InterpreterShim._dummy_gm()


def graph_compilations() -> int:
    """Graphs Dynamo has compiled in this process so far (a recompile counts)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def keeps_guard(entries: list[Any]) -> list[bool]:
    """Dynamo's `guard_filter_fn`: drop the guards on the model (`self`), keep the rest."""
    return [not entry.name.startswith("self") for entry in entries]


class CompiledForward:
    """`model(input_ids, positions, ctx)`, compiled; the step's context set around each call."""

    def __init__(self, model: nn.Module, cache_dir: str | None = None) -> None:
        self.cache_dir = configure_inductor_cache(cache_dir)
        self.model = model
        self._compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            self._forward,
            dynamic=True,
            fullgraph=True,
            backend="inductor",
            options={"guard_filter_fn": keeps_guard},
        )
        self.compile_seconds = 0.0

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # Size-oblivious: a dimension of size 1 is traced as a general size, not
        # specialised, so one graph serves every token count.
        with forward_context(ctx), fx_config.patch(backed_size_oblivious=True):
            return self._compiled(input_ids, positions)

    def warm_up(
        self,
        run_step: Callable[[int], object],
        sizes: tuple[int, ...] = WARM_UP_SIZES,
        on_compiled: Callable[[str], None] | None = None,
    ) -> float:
        """Compile by running `run_step(num_tokens)` for each size; returns the seconds taken.
        `on_compiled("compile")` is called once the first size has run (the graph is built)."""
        start = time.perf_counter()
        for i, n in enumerate(sizes):
            run_step(n)
            if i == 0 and on_compiled is not None:
                on_compiled("compile")
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds
