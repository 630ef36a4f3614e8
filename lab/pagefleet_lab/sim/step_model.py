"""Step-time models for `pagefleet-lab simulate`: how long one engine step takes.

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
  machine (`measure_engine_steps`, `pagefleet-lab simulate --fit`). The committed fit is
  `CPU_FIT` (lab/fits/sim_cpu_fit.json; benchmarks/results/sim_step_fit.md);
  `--fit --fit-for router` writes `ROUTER_FIT_PATH`, the fit for `pagefleet bench
  router`'s replicas (`measure_engine_steps` with `contenders`: see there).
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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np


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


def decode_run_ends(model: StepModel, start: float, n: int, kv0: int, k: int) -> list[float]:
    """The end times of k decode-only steps of `n` sequences from `start`, the i-th
    (1-based) attending kv0 + n * i tokens: `start` plus each step's `model.seconds`, summed
    in order. A decode run plans hundreds of steps at once; a model with
    `decode_seconds` (those below: the same float operations, elementwise) gives them
    as one array, and a running sum in order (`np.cumsum`, not pairwise) adds them up
    exactly as a loop would."""
    decode = getattr(model, "decode_seconds", None)
    if decode is None:
        ends, t = [], start
        for i in range(1, k + 1):
            kv = kv0 + n * i
            t += model.seconds(StepShape(0, n, kv, kv))
            ends.append(t)
        return ends
    kv = kv0 + n * np.arange(1, k + 1, dtype=np.int64)  # [k]
    steps = np.empty(k + 1)
    steps[0] = start
    steps[1:] = decode(n, kv)
    return np.cumsum(steps)[1:].tolist()


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

    def decode_seconds(self, n: int, kv: np.ndarray) -> np.ndarray:
        """`seconds` of decode-only steps of `n` sequences attending `kv` [k] tokens."""
        return self.a + self.b * 0 + self.c * n + self.d * kv


@dataclass(frozen=True)
class ScaledStepModel:
    """Another model's step times, `factor` times longer.

    What a fit of the engine alone leaves out when its replicas serve through Ray Serve
    on the same cores: Serve's proxy, the ingress and the replica actors take CPU from
    the engines' steps. `sim_validation.step_scale` measures the factor from a real
    `bench router` run (its tokens/s against the simulator's on one scenario), to be
    checked on the other scenarios.
    """

    inner: StepModel
    factor: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"step scale must be > 0, not {self.factor}")

    @property
    def name(self) -> str:
        return f"{getattr(self.inner, 'name', 'model')} x {self.factor:g}"

    def seconds(self, shape: StepShape) -> float:
        return self.factor * self.inner.seconds(shape)

    def decode_seconds(self, n: int, kv: np.ndarray) -> np.ndarray:
        """`seconds` of decode-only steps of `n` sequences attending `kv` [k] tokens."""
        inner = getattr(self.inner, "decode_seconds", None)
        if inner is None:
            steps = [self.inner.seconds(StepShape(0, n, x, x)) for x in kv.tolist()]
            return self.factor * np.array(steps)
        return self.factor * inner(n, kv)


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

    def decode_seconds(self, n: int, kv: np.ndarray) -> np.ndarray:
        """`seconds` of decode-only steps of `n` (>= 1) sequences attending `kv` [k]
        tokens (attention pairs: one per token attended)."""
        read = self.weight_bytes + self.kv_bytes_per_token * kv
        flops = self.flops_per_token * n + self.attention_flops_per_pair * kv
        return self.overhead_s + np.maximum(
            read / (self.hbm_bytes_per_s * self.memory_efficiency),
            flops / (self.peak_flops * self.compute_efficiency),
        )


def llama_on_h200(
    name: str, params: float, layers: int, kv_heads: int, head_dim: int, heads: int
) -> RooflineStepModel:
    """The H200 roofline of a Llama-shaped model in bf16 (`params` parameters)."""
    kv_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    weights = 2 * params  # bf16
    # 141 GB of HBM at vLLM's default gpu_memory_utilization 0.9, less the weights and
    # ~4 GB of activations / CUDA graphs (Llama-3.1-8B: ~107 GB of KV).
    kv_bytes = 0.9 * 141e9 - weights - 4e9
    return RooflineStepModel(
        name=name,
        weight_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        flops_per_token=2 * params,
        attention_flops_per_pair=4 * layers * heads * head_dim,
        hbm_bytes_per_s=4.8e12,
        peak_flops=990e12,
        overhead_s=0.002,
        kv_capacity_tokens=int(kv_bytes // kv_per_token),
    )


# Llama-3.1-8B: 8.03B parameters, 32 layers, 8 KV heads of 128 (131,072 KV bytes a token).
H200_LLAMA31_8B = llama_on_h200("H200 + Llama-3.1-8B bf16 (roofline model)", 8.03e9, 32, 8, 128, 32)


# -- the fit -------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    model: LinearStepModel
    points: int
    rmse_s: float
    max_abs_residual_s: float
    r2: float
    median_abs_rel: float  # median |residual| / measured
    # How the steps were measured: the engine's resolved capacity, threads, contenders.
    engine: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = asdict(self.model)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fit:
        return cls(**{**data, "model": LinearStepModel(**data["model"])})


def fit_linear(
    shapes: Sequence[StepShape],
    seconds: Sequence[float],
    name: str = "fit",
    engine: dict[str, Any] | None = None,
) -> Fit:
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
        engine,
    )


# lab/fits/: the fits `pagefleet-lab simulate --fit` writes, kept in the repository
FITS = Path(__file__).resolve().parents[2] / "fits"
CPU_FIT_PATH = FITS / "sim_cpu_fit.json"
ROUTER_FIT_PATH = FITS / "sim_cpu_fit_router.json"


def load_cpu_fit(path: Path = CPU_FIT_PATH) -> Fit:
    return Fit.from_json(json.loads(path.read_text()))


# (requests, prompt tokens, max tokens, steps between two adds: 0 adds them all at once)
Batch = tuple[int, int, int, int]

DEFAULT_FIT_BATCHES: tuple[Batch, ...] = (
    (1, 32, 24, 0),
    (1, 512, 16, 0),
    (4, 64, 32, 0),
    (8, 128, 32, 0),
    (16, 32, 48, 0),
    (16, 256, 24, 0),
    (32, 96, 32, 0),
    (48, 24, 32, 0),
    (2, 900, 8, 0),
    (8, 700, 16, 0),
)
# bench router's replicas: 1-12 sequences (its 12 users over 2 replicas), prompts of its
# scenarios' lengths (16-96 short, 576-768 long), each batch within the replica's 128
# blocks (no preemption); staggered batches make the mixed steps of a closed loop (a new
# prompt's prefill beside the others' decodes).
ROUTER_FIT_BATCHES: tuple[Batch, ...] = (
    (1, 32, 24, 0),
    (1, 700, 16, 0),
    (2, 760, 24, 0),
    (4, 48, 32, 0),
    (6, 64, 40, 3),
    (8, 96, 32, 0),
    (12, 40, 40, 2),
    (12, 80, 24, 0),
    (3, 600, 24, 6),
    (6, 24, 48, 5),
)


def _batch_steps(
    engine: Any,
    batches: Sequence[Batch],
    rng: Any,
    prefix: str,
    step: Any,
    keep_going: Any = None,
) -> Iterator[Any]:
    """Run `batches` one after another on `engine`, calling `step()` for each engine step;
    yields what each call returns. A batch's requests are added at once, or one every
    `every` steps; random prompts (no prefix hits between them)."""
    from pagefleet.bench.workloads import random_tokens
    from pagefleet.engine import SamplingParams

    cap = engine.capacity.max_model_len
    n = 0
    for requests, prompt, out_tokens, every in batches:
        prompt = min(prompt, cap - out_tokens - 1)
        left = requests
        since = every
        while left or engine.has_unfinished_requests():
            if keep_going is not None and not keep_going():
                return
            while left and (every == 0 or since >= every):
                params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
                ids = list(random_tokens(rng, prompt, engine.vocab_size))
                engine.add_request(f"{prefix}{n}", {"prompt_token_ids": ids}, params)
                n += 1
                left -= 1
                since = 0
                if every:
                    break
            since += 1
            yield step()


def _contend(config: Any, batches: Sequence[Batch], seed: int, ready: Any, stop: Any) -> None:
    """A contender (`measure_engine_steps`): the same engine, stepping `batches` over and
    over until `stop`; `ready` once it has been through them once (compiled, warm)."""
    import itertools
    import random

    from pagefleet.engine import LLMEngine

    engine = LLMEngine(config)
    rng = random.Random(seed)
    try:
        for rep in itertools.count():
            if stop.is_set():
                break
            for _ in _batch_steps(
                engine, batches, rng, f"c{rep}-", engine.step_deltas, lambda: not stop.is_set()
            ):
                pass
            ready.set()
    finally:
        engine.close()


def measure_engine_steps(
    model: str,
    shapes: Sequence[Batch] = (),
    repeats: int = 3,
    threads: int = 2,
    block_size: int = 16,
    config: Any = None,
    contenders: int = 0,
    info: dict[str, Any] | None = None,
) -> tuple[list[StepShape], list[float]]:
    """Time steps of the real engine (`LLMEngine`, in process) over a spread of batches.

    Each `(requests, prompt_tokens, max_tokens, every)` batch is added (at once, or one
    request every `every` steps) and stepped to the end, `repeats` times; every step is
    timed and its shape read from the `SchedulerOutput` it ran. Prompts are random
    tokens (no prefix hits), chunked prefill at the engine's budget, so steps mix prefill
    chunks and decodes as in serving. The schedule is the same on every repeat, so each
    distinct shape is measured `repeats` times.

    Two ways to run it:

    - alone (the default, `contenders` 0): `LLMEngine(model, threads, block_size, a
      large pool, no prefix caching)`, each step timed around `LLMEngine.step`, and each
      shape keeps its fastest time: what other work on a shared machine adds is only
      ever added, so the fastest is the engine's own cost.
    - as a replica of a fleet on this machine: `config` is the replica's `EngineConfig`
      exactly (bench router's: `ServeConfig.engine_config()` of its fleet config, one
      thread, 128 blocks, prefix caching on, compiled unless PAGEFLEET_ENFORCE_EAGER says
      otherwise, as in the replicas), each step timed as the replica's
      engine core runs it (`EngineCore.step`: the step, its deltas, the stats snapshot,
      and `encode_events`, the message it sends), and `contenders` more engines of the
      same config step the same batches over and over in processes of their own
      meanwhile (spawned; the timing starts once each has been through them once). Two
      bench router replicas share this machine's cores, caches and memory bandwidth,
      each stepping most of the time under its closed loop; a contender is the other
      one. Here contention is what is measured, so each shape keeps its median, not
      its fastest. What a contender does not stand for: Serve's proxy, the ingress and
      the replica actors (streaming each token to its client), which take their share
      of the same cores in a real run: their cost is not in the fit, and shows as the
      simulator running fast.

    `info`, if given, receives how the steps were measured (the engine's resolved
    capacity, threads, contenders, the statistic kept), for the fit to record.
    """
    import multiprocessing as mp
    import random
    import statistics
    import time

    from pagefleet.engine import LLMEngine
    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.core_messages import CoreEvents, encode_events
    from pagefleet.engine.engine_core import EngineCore

    batches = tuple(shapes) or (ROUTER_FIT_BATCHES if config is not None else DEFAULT_FIT_BATCHES)
    if config is None:
        config = EngineConfig(
            model=model,
            block_size=block_size,
            num_kv_blocks=4096,
            max_num_seqs=64,
            num_threads=threads,
            enable_prefix_caching=False,
        )
        as_core = False
    else:
        as_core = True
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    rivals = []
    for i in range(contenders):
        ready = ctx.Event()
        proc = ctx.Process(
            target=_contend, args=(config, batches, 1000 + i, ready, stop), daemon=True
        )
        proc.start()
        rivals.append((proc, ready))
    engine = LLMEngine(config)
    token_engine = engine.token_engine
    scheduled: list[Any] = []
    schedule = token_engine.scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        # The shape before the step runs: progress is what the step starts from.
        scheduled.append(step_shape(out))
        return out

    token_engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    core = EngineCore(engine)

    def timed_step() -> tuple[StepShape | None, float]:
        scheduled.clear()
        t0 = time.perf_counter()
        if as_core:
            events = CoreEvents()
            core.step(events)
            encode_events(events)
        else:
            engine.step()
        dt = time.perf_counter() - t0
        return (scheduled[0] if scheduled else None), dt

    rng = random.Random(0)
    times: dict[StepShape, list[float]] = {}
    try:
        for rep in range(repeats + 1):  # the first pass warms up, untimed
            if rep == 1:
                for proc, ready in rivals:  # contention from the first timed step on
                    while not ready.wait(1.0):
                        if not proc.is_alive():
                            raise RuntimeError(f"a contender exited ({proc.exitcode})")
            for shape, dt in _batch_steps(engine, batches, rng, f"fit{rep}-", timed_step):
                if rep and shape and shape.prefill_tokens + shape.decode_seqs:
                    times.setdefault(shape, []).append(dt)
    finally:
        stop.set()
        for proc, _ in rivals:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        engine.close()
    keep = statistics.median if contenders else min
    if info is not None:
        cap = engine.capacity
        info.update(
            model=Path(config.model).name,
            dtype=config.dtype,
            num_threads=config.num_threads,
            num_kv_blocks=cap.num_kv_blocks,
            block_size=cap.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=cap.max_model_len,
            max_num_batched_tokens=cap.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            timed="EngineCore.step + encode_events" if as_core else "LLMEngine.step",
            contenders=contenders,
            kept="median" if contenders else "fastest",
            repeats=repeats,
            batches=[list(b) for b in batches],
        )
    return list(times), [keep(v) for v in times.values()]
