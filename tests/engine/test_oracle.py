"""Greedy tokens must equal transformers' `generate`, token for token, in any batch mix."""

from __future__ import annotations

import itertools

import pytest

from pagefleet.engine import LLM, SamplingParams
from tests.conftest import hf_greedy, prompt_ids

MAX_NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest) -> tuple[str, list[list[int]], list[list[int]]]:
    path = request.getfixturevalue(f"{request.param}_dir")
    prompts = prompt_ids(path)
    expected = [hf_greedy(path, ids, MAX_NEW) for ids in prompts]
    return path, prompts, expected


def _run(path: str, prompts: list[list[int]], **engine_args: object) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=path, dtype="float32", **engine_args)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    assert [o.prompt_token_ids for o in outs] == prompts
    return llm, [o.outputs[0].token_ids for o in outs]


def test_prompts_have_mixed_lengths(checkpoint) -> None:
    _, prompts, _ = checkpoint
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 12
    assert lengths[0] == 1 and lengths[-1] >= 20


def test_batched_greedy_equals_transformers(checkpoint) -> None:
    path, prompts, expected = checkpoint
    llm, got = _run(path, prompts, block_size=16, num_kv_blocks=256, max_num_seqs=16)
    assert got == expected
    stats = llm.stats()
    assert stats.num_preemptions == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 256
    llm.check_block_accounting()


def test_greedy_equals_transformers_under_preemption(checkpoint) -> None:
    path, prompts, expected = checkpoint
    # 14 blocks of 8 tokens cannot hold all 14 sequences at once.
    llm, got = _run(
        path, prompts, block_size=8, num_kv_blocks=14, max_model_len=112, max_num_seqs=14
    )
    assert llm.stats().num_preemptions > 0
    assert got == expected
    llm.check_block_accounting()


def test_greedy_equals_transformers_one_sequence_at_a_time(checkpoint) -> None:
    path, prompts, expected = checkpoint
    llm, got = _run(path, prompts, num_kv_blocks=64, max_num_seqs=1)
    assert got == expected
    llm.check_block_accounting()


def test_greedy_equals_transformers_with_chunked_prefill(checkpoint) -> None:
    path, prompts, expected = checkpoint
    llm, got = _run(path, prompts, num_kv_blocks=128, max_num_batched_tokens=7)
    assert got == expected
    llm.check_block_accounting()


@pytest.mark.parametrize("path", ["prefill kernel", "torch flash"])
def test_greedy_equals_transformers_on_long_prompts(checkpoint, monkeypatch, path) -> None:
    """Prompts of 70-266 tokens through the CPU path's prefill kernel, or through torch's
    per-chunk flash attention where that kernel is not built: whole, in chunks that attend
    over cached context, and behind a cached shared prefix."""
    from pagefleet.kernels import cpu_attention, cpu_paged_prefill

    path_, prompts, _ = checkpoint
    # 70-250 tokens: every text in turn, repeated, each prompt starting at another.
    long_prompts = [
        list(itertools.islice(itertools.cycle(itertools.chain(*prompts[i:], *prompts[:i])), n))
        for i, n in enumerate((70, 130, 250))
    ]
    shared = long_prompts[2][:200]
    long_prompts += [[*shared, 5, 6, 7], [*shared, *[9] * 66]]  # a cached 192-token prefix each
    expected = [hf_greedy(path_, ids, MAX_NEW) for ids in long_prompts]
    calls = 0
    if path == "torch flash":
        monkeypatch.setattr(cpu_paged_prefill, "supports", lambda query, k_cache: False)
    module, name = (
        (cpu_paged_prefill, "paged_prefill")
        if path == "prefill kernel"
        else (cpu_attention, "_chunks_by_flash")
    )
    taken = getattr(module, name)

    def counted(*args: object) -> None:
        nonlocal calls
        calls += 1
        taken(*args)

    monkeypatch.setattr(module, name, counted)
    # Chunks of at most 96 tokens, all prompts at once; then whole prompts one at a time,
    # the last two behind the third's cached blocks.
    for engine_args in ({"max_num_batched_tokens": 96}, {"max_num_seqs": 1}):
        calls = 0
        llm, got = _run(path_, long_prompts, block_size=16, num_kv_blocks=128, **engine_args)
        assert got == expected, engine_args
        assert calls > 0, engine_args
        llm.check_block_accounting()


def test_output_order_and_text(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=64)
    texts = ["import os", "class A:", "x = 1"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tok = llm.get_tokenizer()
    for text, out in zip(texts, outs, strict=True):
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text)
        completion = out.outputs[0]
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")
    llm.check_block_accounting()


@pytest.mark.compile
def test_compiled_greedy_equals_transformers(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled forward (torch.compile, at start-up) gives transformers' tokens, with
    chunked prefill (decodes and chunks in one step) and preemption, and compiles nothing
    after start-up whatever the batch sizes. Its guards are on the inputs and the global
    state, none on the model."""
    from pagefleet.engine import compiled_forward
    from pagefleet.engine.compiled_forward import graph_compilations

    guards: dict[str, bool] = {}
    keeps = compiled_forward.keeps_guard

    def keeps_guard(entries: list) -> list[bool]:
        kept = keeps(entries)
        guards.update({f"{e.guard_type} {e.name}": k for e, k in zip(entries, kept, strict=True)})
        return kept

    monkeypatch.setattr(compiled_forward, "keeps_guard", keeps_guard)

    prompts = prompt_ids(llama_dir)
    expected = [hf_greedy(llama_dir, ids, MAX_NEW) for ids in prompts]
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        enforce_eager=False,
        block_size=8,
        num_kv_blocks=14,
        max_model_len=112,
        max_num_seqs=14,
        max_num_batched_tokens=32,
    )
    runner = llm.engine.token_engine.runner
    assert runner.compiled is not None and runner.decode_graphs is None  # no CUDA here
    compiled_at_start = graph_compilations()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats().num_preemptions > 0
    assert graph_compilations() == compiled_at_start, "a step recompiled after start-up"
    llm.check_block_accounting()
    assert guards["TENSOR_MATCH input_ids"] and guards["TENSOR_MATCH positions"]
    assert guards["GRAD_MODE "]
    on_model = [name for name in guards if name.split(" ", 1)[1].startswith("self")]
    assert len(on_model) > 100 and not any(guards[name] for name in on_model)
