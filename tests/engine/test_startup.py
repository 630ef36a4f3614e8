"""The start-up timeline, the compile cache's directory, and compiling in the background.

Compiling in the background (`compile_in_background`) must not change a token: the
steps run eagerly, then compiled from the step after the graph is ready, and greedy
tokens equal transformers' across the switch.
"""

from __future__ import annotations

import threading

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.startup import StartupTimeline
from tests.conftest import hf_greedy, prompt_ids

MAX_NEW = 24


def test_timeline_phases_are_contiguous_and_in_order() -> None:
    t = StartupTimeline(100.0)
    t.mark("process", 101.5)
    t.mark("imports", 104.0)
    t.mark("weights", 104.25)
    assert t.durations() == {"process": 1.5, "imports": 2.5, "weights": 0.25}
    assert list(t.durations()) == ["process", "imports", "weights"]
    assert t.end == 104.25 and t.has("imports") and not t.has("compile")
    assert t.summary() == "process 1.50 s, imports 2.50 s, weights 0.25 s; 4.25 s in all"
    with pytest.raises(ValueError, match="unknown start-up phase"):
        t.mark("lunch")


def test_engine_marks_its_phases_in_order(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=16, enforce_eager=True)
    # Eager: nothing compiled, so no compile or warm-up phase.
    assert list(llm.engine.startup.durations()) == ["tokenizer", "weights"]


def test_compile_cache_dir_is_where_inductor_caches(
    llama_dir: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from pagefleet.cluster.config import EngineSettings
    from pagefleet.engine.compiled_forward import configure_inductor_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "from-env"))
    assert configure_inductor_cache() == str(tmp_path / "from-env")  # the user's is kept
    shared = str(tmp_path / "shared")
    assert configure_inductor_cache(shared) == shared
    assert cache_dir() == shared  # what inductor itself reads
    settings = EngineSettings(compile_cache_dir=shared)
    assert settings.to_engine_config(llama_dir).compile_cache_dir == shared


@pytest.mark.compile
def test_background_compile_keeps_greedy_tokens_across_the_switch(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager steps while the graph builds (held until the first run ends), then a run
    during which the forward switches, then compiled steps: transformers' tokens in all
    three, no recompilation after the switch, and every block back in the pool."""
    from torch._inductor.loop_body import InterpreterShim

    from pagefleet.engine.compiled_forward import CompiledForward, graph_compilations

    # Inductor's one `torch.fx.symbolic_trace` is made before the compile thread starts:
    # during a symbolic trace every module call in the process is the tracer's, and an
    # eager step then fails.
    InterpreterShim._dummy_gm.cache_clear()
    release = threading.Event()
    warm_up = CompiledForward.warm_up

    def held_warm_up(self: CompiledForward, *args: object, **kwargs: object) -> float:
        release.wait()
        return warm_up(self, *args, **kwargs)

    monkeypatch.setattr(CompiledForward, "warm_up", held_warm_up)
    prompts = prompt_ids(llama_dir)
    expected = [hf_greedy(llama_dir, ids, MAX_NEW) for ids in prompts]
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        enforce_eager=False,
        compile_in_background=True,
        block_size=8,
        num_kv_blocks=14,
        max_model_len=112,
        max_num_seqs=14,
        max_num_batched_tokens=32,
    )
    runner = llm.engine.token_engine.runner
    assert InterpreterShim._dummy_gm.cache_info().currsize == 1

    def greedy() -> list[list[int]]:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outs]

    assert greedy() == expected
    assert runner.compiled is None  # every step of that run was eager
    release.set()
    assert greedy() == expected  # the switch falls somewhere in (or before) this run
    assert runner.wait_compiled(600)
    compiled = graph_compilations()
    assert greedy() == expected
    assert graph_compilations() == compiled, "a step recompiled after the switch"
    assert llm.stats().num_preemptions > 0
    llm.check_block_accounting()
