"""A step that raises fails only its own requests; the pool balances; the rest are served.

Failures are injected (monkeypatched to raise once) at each point a step can
fail: scheduling, the copy-on-write copy, the forward pass, sampling and the
output side. After each, the requests that were only waiting (or running but
not reached by a failed scheduling decision) must give exactly the greedy
tokens of a fresh engine, also under tensor parallelism, where rank 0's
failure must not leave the other rank in a collective of its own.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from pagefleet.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pagefleet.engine.core_messages import AddRequest, CoreEvents, RequestError
from pagefleet.engine.engine_core import EngineCore
from pagefleet.engine.errors import EngineBrokenError, RanksOutOfStepError
from pagefleet.engine.output_accumulator import OutputAccumulator
from tests.conftest import prompt_ids

# max_num_seqs=2: a request with n=2 (or two requests) fills the batch, so one added
# next waits and is not in the step that fails.
CONFIG = {"num_kv_blocks": 32, "block_size": 8, "max_num_seqs": 2, "max_model_len": 128}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 13 tokens: the first step computes 12 and forks; the next writes token 12 into the
# shared, partly filled second block, so sample 0 gets a copy of it.
FORKING_PROMPT = list(range(5, 18))
FORK = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
INJECTED = "engine step failed: RuntimeError: injected failure"


def fail_once(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[tuple]:
    """Make `obj.name` raise RuntimeError on its next call only; returns the calls' args."""
    original = getattr(obj, name)
    calls: list[tuple] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


def prompts(llama_dir: str) -> dict[str, list[int]]:
    ids = prompt_ids(llama_dir)
    return {"b": ids[6], "w": ids[2], "x": ids[4]}


@pytest.fixture(scope="module")
def reference(llama_dir: str) -> dict[str, list[list[int]]]:
    """Every request's tokens (each sample's) on a fresh single-process engine."""
    p = prompts(llama_dir)
    with LLM(model=llama_dir, **CONFIG) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p[k]} for k in ("b", "w", "x")], GREEDY, use_tqdm=False
        )
        fork = llm.generate({"prompt_token_ids": FORKING_PROMPT}, FORK, use_tqdm=False)[0]
    ref = {k: [o.outputs[0].token_ids] for k, o in zip(("b", "w", "x"), outs, strict=True)}
    ref["a"] = [c.token_ids for c in fork.outputs]
    return ref


# The core's events hold each step's news: a caller's OutputAccumulator per core (the
# engine's own way back to whole outputs) takes every step a test runs, and keeps the
# requests that finished.
_WHOLE: weakref.WeakKeyDictionary[
    EngineCore, tuple[OutputAccumulator, dict[str, RequestOutput]]
] = weakref.WeakKeyDictionary()


def step(core: EngineCore, *adds: AddRequest) -> CoreEvents:
    events = CoreEvents()
    core.apply(list(adds), events)
    assert core.step(events) is None
    assert not events.rejected
    whole, finished = _WHOLE.setdefault(core, (OutputAccumulator(), {}))
    for cmd in adds:
        whole.add(cmd.request_id, None, cmd.prompt["prompt_token_ids"])
    for err in events.failed:
        whole.discard(err.request_id)
    for d in events.outputs:
        if (out := whole.apply_final(d)) is not None:
            finished[out.request_id] = out
    return events


def finish(core: EngineCore, done: dict[str, list[list[int]]] | None = None) -> dict:
    """Step until idle; every finished request's tokens, per sample."""
    done = {} if done is None else done
    while core.engine.has_unfinished_requests():
        assert not step(core).failed
    for rid, out in _WHOLE[core][1].items():
        done[rid] = [c.token_ids for c in out.outputs]
    _WHOLE[core][1].clear()
    return done


def add(rid: str, ids: list[int], params: SamplingParams = GREEDY) -> AddRequest:
    return AddRequest(rid, {"prompt_token_ids": ids}, params)


@pytest.mark.parametrize("point", ["schedule", "forward", "sample", "output"])
def test_a_failed_step_fails_only_its_requests(
    llama_dir: str, reference: dict, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    p = prompts(llama_dir)
    engine = LLMEngine(EngineConfig(model=llama_dir, **CONFIG))
    core = EngineCore(engine)
    te = engine.token_engine
    step(core, add("a", p["x"]), add("b", p["b"]))  # both prefill
    targets = {
        "schedule": (te.block_manager, "allocate"),  # a running sequence's blocks
        "forward": (te.runner, "forward"),
        "sample": (te.runner, "sample"),
        "output": (engine.output_processor, "process"),
    }
    fail_once(monkeypatch, *targets[point])
    events = step(core, add("w", p["w"]))  # "w" waits: the batch is full

    (w_seq,) = te.sequences("w")
    assert list(te.scheduler.waiting) == [w_seq]  # untouched: never scheduled, no blocks
    assert (w_seq.num_computed_tokens, w_seq.block_table) == (0, [])
    if point == "schedule":
        # The decision failed on "a", the oldest running request: "b" was not reached
        # and keeps its prompt's blocks and progress.
        assert events.failed == [RequestError("a", "RequestFailedError", INJECTED)]
        (b_seq,) = te.sequences("b")
        assert te.scheduler.running == [b_seq]
        assert b_seq.num_computed_tokens == len(p["b"])
        assert len(b_seq.block_table) == -(-(len(p["b"]) + 1) // 8)
        assert engine.stats().num_free_blocks == 32 - len(b_seq.block_table)
        assert engine.unfinished_request_ids() == ["b", "w"]
    else:
        assert events.failed == [
            RequestError("a", "RequestFailedError", INJECTED),
            RequestError("b", "RequestFailedError", INJECTED),
        ]
        assert te.scheduler.running == []
        assert engine.stats().num_free_blocks == 32
        assert engine.unfinished_request_ids() == ["w"]
    assert events.outputs == []
    engine.check_block_accounting()

    done = finish(core)
    step(core, add("x", p["x"]))  # a request arriving after the failure
    done = finish(core, done)
    expected = {"w": reference["w"], "x": reference["x"]}
    if point == "schedule":
        expected["b"] = reference["b"]
    assert done == expected
    engine.check_block_accounting()
    assert engine.stats().num_free_blocks == 32


def test_a_copy_on_write_copy_that_fails_leaves_no_table_on_its_block(
    llama_dir: str, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prompts(llama_dir)
    engine = LLMEngine(EngineConfig(model=llama_dir, **CONFIG))
    core = EngineCore(engine)
    te, bm = engine.token_engine, engine.token_engine.block_manager
    step(core, add("a", FORKING_PROMPT, FORK))  # 12 tokens in blocks 0, 1; forks
    s0, s1 = te.sequences("a")
    assert s0.block_table == s1.block_table == [0, 1]
    assert [bm.ref_count(0), bm.ref_count(1)] == [2, 2]
    copies = fail_once(monkeypatch, te.runner, "_copy_blocks")

    events = step(core, add("w", p["w"]))  # "w" waits: the two samples fill the batch
    # Sample 0 was given block 2 for its copy of block 1; the copy raised.
    assert copies == [([(1, 2)],)]
    assert events.failed == [RequestError("a", "RequestFailedError", INJECTED)]
    assert te.sequences("a") == [] and s0.is_finished and s1.is_finished
    assert s0.block_table == s1.block_table == []
    # Every block free: block 2 (never copied into) was freed first, then 1 and 0.
    assert bm.free_block_ids() == [*range(3, 32), 2, 1, 0]
    # Only the full, computed prompt block is cached: block 2's garbage has no hash,
    # so no prefix lookup can ever hand it out as computed K/V.
    assert bm.num_cached_blocks == 1
    assert list(te.scheduler.waiting) == te.sequences("w")
    engine.check_block_accounting()

    done = finish(core)
    step(core, add("x", p["x"]), add("a2", FORKING_PROMPT, FORK))
    done = finish(core, done)
    assert done == {"w": reference["w"], "x": reference["x"], "a2": reference["a"]}
    assert len(copies) == 2  # "a2" copied for real
    engine.check_block_accounting()
    assert engine.stats().num_free_blocks == 32


def with_deadline(fn: Callable[[], None], seconds: float) -> None:
    """Run `fn` in a thread; fail (not hang) if it does not finish in `seconds`.

    A tensor-parallel desync shows as a collective that never completes (its
    time-out is a minute): the deadline turns it into a failure.
    """
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: ranks out of step?"
    if error:
        raise error[0]


def test_tensor_parallel_ranks_stay_in_step_after_a_failed_step(
    llama_dir: str, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prompts(llama_dir)
    engine = LLMEngine(EngineConfig(model=llama_dir, tensor_parallel_size=2, **CONFIG))
    te = engine.token_engine
    assert te.executor is not None
    executor = te.executor
    sends: list[object] = []
    send = executor.send
    monkeypatch.setattr(executor, "send", lambda inputs: (sends.append(inputs), send(inputs)))
    core = EngineCore(engine)

    def scenario() -> None:
        # Before the ranks are told: rank 0's copy-on-write copy fails.
        step(core, add("a", FORKING_PROMPT, FORK))
        assert len(sends) == 1
        fail_once(monkeypatch, te.runner, "_copy_blocks")
        events = step(core, add("w", p["w"]))
        assert events.failed == [RequestError("a", "RequestFailedError", INJECTED)]
        assert len(sends) == 1  # rank 1 was never sent the failed step
        assert engine.stats().num_free_blocks == 32
        # After every rank's forward pass: rank 0's sampling fails.
        fail_once(monkeypatch, te.runner, "sample")
        events = step(core)
        assert events.failed == [RequestError("w", "RequestFailedError", INJECTED)]
        assert len(sends) == 2  # rank 1 ran it, and waits for the next step
        assert engine.stats().num_free_blocks == 32
        done = finish(core)
        step(core, add("w2", p["w"]), add("x", p["x"]))
        done = finish(core, done)
        step(core, add("a2", FORKING_PROMPT, FORK))
        done = finish(core, done)
        assert done == {"w2": reference["w"], "x": reference["x"], "a2": reference["a"]}
        engine.check_block_accounting()

    try:
        with_deadline(scenario, 60)
    finally:
        engine.close()
    assert not executor.out_of_step
    assert [w.is_alive() for w in executor.processes] == [False]  # stopped by its signal


def test_rank_0_failing_inside_a_tensor_parallel_forward_breaks_the_engine(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prompts(llama_dir)
    engine = LLMEngine(EngineConfig(model=llama_dir, tensor_parallel_size=2, **CONFIG))
    te = engine.token_engine
    executor = te.executor
    assert executor is not None
    core = EngineCore(engine)
    step(core, add("a", p["x"]), add("b", p["b"]))
    # Rank 1 has its inputs and is inside the step's collectives when rank 0 raises.
    fail_once(monkeypatch, te.runner, "forward")
    events = CoreEvents()
    core.apply([add("w", p["w"])], events)
    broken = core.step(events)
    assert isinstance(broken, RanksOutOfStepError)
    assert str(broken) == (
        "rank 0 failed inside a tensor-parallel step (RuntimeError: injected failure); "
        "the ranks are out of step"
    )
    # Every request fails, the waiting one too: nothing can be served any more.
    message = f"engine step failed: RanksOutOfStepError: {broken}"
    assert events.failed == [
        RequestError(r, "RequestFailedError", message) for r in ("a", "b", "w")
    ]
    assert engine.unfinished_request_ids() == []
    assert engine.stats().num_free_blocks == 32
    engine.check_block_accounting()
    engine.add_request("later", {"prompt_token_ids": p["w"]}, GREEDY)
    with pytest.raises(EngineBrokenError, match="the engine can no longer step: rank 0 failed"):
        engine.step()
    engine.abort_request("later")
    # Closing does not talk to the stuck rank (that would pair with its collective):
    # it is ended at once.
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 10
    assert executor.out_of_step
    assert [w.is_alive() for w in executor.processes] == [False]


def test_a_tracer_that_raises_fails_no_request(llama_dir: str, reference: dict) -> None:
    """Tracing is observability: a span that cannot be made is logged and dropped, and
    every request is served as without a tracer."""
    from pagefleet.engine.tracing import CoreTracer

    class Broken:
        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("collector gone")

    p = prompts(llama_dir)
    engine = LLMEngine(EngineConfig(model=llama_dir, **CONFIG))
    core = EngineCore(engine, tracer=CoreTracer(Broken(), "m"))
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    step(core, AddRequest("b", {"prompt_token_ids": p["b"]}, GREEDY, headers))
    step(core, add("w", p["w"]))  # still running when b's span fails to be made
    assert finish(core) == {"b": reference["b"], "w": reference["w"]}
    engine.check_block_accounting()
    assert engine.stats().num_free_blocks == 32
