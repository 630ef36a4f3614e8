"""Step-time models for `pagefleet bench simulate`: how long one engine step takes.

A step's cost is read from its shape (`StepShape`, the same function of a real
`SchedulerOutput` in the fit and in the simulator):

- `prefill_tokens`: tokens of the sequences computing more than one token this step
  (a prompt, a prompt chunk, or a preempted sequence's recompute);
- `decode_seqs`: sequences computing exactly one token (decoding);
- `attended_kv_tokens`: the KV length each scheduled sequence attends to once the step
  is done (num_computed_tokens + scheduled), summed: the KV bytes a step reads;
- `attention_pairs`: query x key pairs of the step's attention (each new token attends
  to every earlier one of its sequence): the attention FLOPs, for the roofline only.

Two models:

- `LinearStepModel`, `t = a + b * prefill_tokens + c * decode_seqs + d * attended_kv_tokens`,
  fitted by least squares (`fit_linear`) to steps of the real engine measured on this
  machine (`measure_engine_steps`, `pagefleet bench simulate --fit`). The committed fit is
  `CPU_FIT` (sim_cpu_fit.json beside this file; benchmarks/results/sim_step_fit.md).
- `RooflineStepModel`, a GPU roofline **model** (not a measurement): an H200 serving
  Llama-3.1-8B in bf16 (`H200_LLAMA31_8B`). A step reads the weights once and the KV of
  every attended token, and does 2 FLOPs per parameter per token plus the attention's;
  it takes the longer of bytes / bandwidth and FLOPs / peak, plus a fixed overhead
  (launches, sampling, scheduling). Peak figures, no efficiency factor unless one is
  given: a lower bound on a real H200's step time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol


class StepShape(NamedTuple):
    prefill_tokens: int
    decode_seqs: int
    attended_kv_tokens: int
    attention_pairs: int


def step_shape(out: Any) -> StepShape:
    """The shape of a scheduled step (an engine `SchedulerOutput`)."""
    prefill = decode = kv = pairs = 0
    for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
        done = seq.num_computed_tokens
        if n == 1:
            decode += 1
        else:
            prefill += n
        kv += done + n
        pairs += n * done + n * (n + 1) // 2
    return StepShape(prefill, decode, kv, pairs)


class StepModel(Protocol):
    def seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class LinearStepModel:
    """t = a + b * prefill_tokens + c * decode_seqs + d * attended_kv_tokens (seconds)."""

    a: float
    b: float
    c: float
    d: float
    name: str = "linear"

    def seconds(self, shape: StepShape) -> float:
        return (
            self.a
            + self.b * shape.prefill_tokens
            + self.c * shape.decode_seqs
            + self.d * shape.attended_kv_tokens
        )


@dataclass(frozen=True)
class RooflineStepModel:
    """max(bytes / bandwidth, FLOPs / peak) + overhead: a GPU roofline, a model."""

    name: str
    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float  # 2 x parameters
    attention_flops_per_pair: float  # 4 x layers x heads x head_dim (QK^T and PV)
    hbm_bytes_per_s: float
    peak_flops: float
    overhead_s: float
    kv_capacity_tokens: int  # what the KV pool holds on this GPU (see `H200_LLAMA31_8B`)
    memory_efficiency: float = 1.0
    compute_efficiency: float = 1.0

    def seconds(self, shape: StepShape) -> float:
        tokens = shape.prefill_tokens + shape.decode_seqs
        if tokens == 0:
            return 0.0
        read = self.weight_bytes + self.kv_bytes_per_token * shape.attended_kv_tokens
        flops = (
            self.flops_per_token * tokens + self.attention_flops_per_pair * shape.attention_pairs
        )
        return self.overhead_s + max(
            read / (self.hbm_bytes_per_s * self.memory_efficiency),
            flops / (self.peak_flops * self.compute_efficiency),
        )


def _llama31_8b_on_h200() -> RooflineStepModel:
    layers, kv_heads, head_dim, heads = 32, 8, 128, 32
    params = 8.03e9
    kv_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16: 131,072 B
    weights = 2 * params  # bf16: ~16 GB
    # 141 GB of HBM at vLLM's default gpu_memory_utilization 0.9, less the weights and
    # ~4 GB of activations / CUDA graphs: ~107 GB of KV.
    kv_bytes = 0.9 * 141e9 - weights - 4e9
    return RooflineStepModel(
        name="H200 + Llama-3.1-8B bf16 (roofline model)",
        weight_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        flops_per_token=2 * params,
        attention_flops_per_pair=4 * layers * heads * head_dim,
        hbm_bytes_per_s=4.8e12,
        peak_flops=990e12,
        overhead_s=0.002,
        kv_capacity_tokens=int(kv_bytes // kv_per_token),
    )


H200_LLAMA31_8B = _llama31_8b_on_h200()


# -- the fit -------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    model: LinearStepModel
    points: int
    rmse_s: float
    max_abs_residual_s: float
    r2: float
    median_abs_rel: float  # median |residual| / measured

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = asdict(self.model)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fit:
        return cls(**{**data, "model": LinearStepModel(**data["model"])})


def fit_linear(shapes: Sequence[StepShape], seconds: Sequence[float], name: str = "fit") -> Fit:
    """Least-squares a, b, c, d for measured steps (numpy's lstsq)."""
    import numpy as np

    if len(shapes) != len(seconds) or len(shapes) < 4:
        raise ValueError("need at least 4 (shape, seconds) points, as many of each")
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.attended_kv_tokens] for s in shapes])
    y = np.array(seconds, dtype=float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    rel = np.abs(resid) / np.maximum(np.abs(y), 1e-12)
    return Fit(
        LinearStepModel(*(float(c) for c in coef), name=name),
        len(y),
        float(math.sqrt((resid**2).mean())),
        float(np.abs(resid).max()),
        1.0 - float((resid**2).sum()) / ss_tot if ss_tot else 1.0,
        float(np.median(rel)),
    )


CPU_FIT_PATH = Path(__file__).with_name("sim_cpu_fit.json")


def load_cpu_fit(path: Path = CPU_FIT_PATH) -> Fit:
    return Fit.from_json(json.loads(path.read_text()))


def measure_engine_steps(
    model: str,
    shapes: Sequence[tuple[int, int, int]] = (),
    repeats: int = 3,
    threads: int = 2,
    block_size: int = 16,
) -> tuple[list[StepShape], list[float]]:
    """Time steps of the real engine (`LLMEngine`, in process) over a spread of batches.

    Each `(requests, prompt_tokens, max_tokens)` batch is added at once and stepped to
    the end, `repeats` times; every step (schedule, forward, sample, update) is timed
    around `TokenEngine.step` and its shape read from the `SchedulerOutput` it ran.
    Prompts are random tokens (no prefix hits), chunked prefill at the engine's
    default budget, so steps mix prefill chunks and decodes as in serving. The schedule
    is the same on every repeat, so each distinct shape keeps its fastest time: what
    other work on a shared machine adds is only ever added.
    """
    import random
    import time

    from pagefleet.engine import LLMEngine, SamplingParams
    from pagefleet.engine.config import EngineConfig

    from .workloads import random_tokens

    shapes = shapes or (
        (1, 32, 24),
        (1, 512, 16),
        (4, 64, 32),
        (8, 128, 32),
        (16, 32, 48),
        (16, 256, 24),
        (32, 96, 32),
        (48, 24, 32),
        (2, 900, 8),
        (8, 700, 16),
    )
    engine = LLMEngine(
        EngineConfig(
            model=model,
            block_size=block_size,
            num_kv_blocks=4096,
            max_num_seqs=64,
            num_threads=threads,
            enable_prefix_caching=False,
        )
    )
    token_engine = engine.token_engine
    scheduled: list[Any] = []
    schedule = token_engine.scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        # The shape before the step runs: progress is what the step starts from.
        scheduled.append(step_shape(out))
        return out

    token_engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    rng = random.Random(0)
    cap = engine.capacity.max_model_len
    fastest: dict[StepShape, float] = {}
    n = 0
    try:
        for rep in range(repeats + 1):  # the first pass warms up, untimed
            for requests, prompt, out_tokens in shapes:
                prompt = min(prompt, cap - out_tokens - 1)
                for _ in range(requests):
                    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
                    ids = list(random_tokens(rng, prompt, engine.vocab_size))
                    engine.add_request(f"fit{n}", {"prompt_token_ids": ids}, params)
                    n += 1
                while engine.has_unfinished_requests():
                    scheduled.clear()
                    t0 = time.perf_counter()
                    engine.step()
                    dt = time.perf_counter() - t0
                    shape = scheduled[0] if scheduled else None
                    if rep and shape and shape.prefill_tokens + shape.decode_seqs:
                        fastest[shape] = min(dt, fastest.get(shape, dt))
    finally:
        engine.close()
    return list(fastest), list(fastest.values())
