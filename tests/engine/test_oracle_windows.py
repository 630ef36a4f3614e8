"""Sliding windows and soft-capping end to end: greedy tokens equal transformers' `generate`.

Six families, each saved by transformers at a tiny shape with a 12-token window
(shorter than most prompts and no multiple of a block size): Mistral, Mixtral and
Phi-3 (every layer windowed, so blocks out of the window go back to the pool while
sequences run), Qwen2 with `use_sliding_window` (its first layer global), Gemma 2
(sliding and global layers, attention and final logit soft-caps) and Gemma 3
(sliding and global layers, q/k norms, a rope base per layer type). Each runs
batched, under preemption, with chunked prefill, behind cached prefixes longer than
the window, and through the reference path as well as the C kernels; blocks balance
after every run.
"""

from __future__ import annotations

import itertools

import pytest

from pagefleet.cluster.make_model import make_model
from pagefleet.engine import LLM, SamplingParams
from tests.conftest import hf_greedy, prompt_ids

MAX_NEW = 24
WINDOW = 12
FAMILIES = ["mistral", "mixtral", "phi3", "qwen2", "gemma2", "gemma3"]
# Families whose every layer slides: their sequences free blocks as the window moves.
EVERY_LAYER = ("mistral", "mixtral", "phi3")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, checkpoint, prompts, transformers' tokens for them)."""
    arch = request.param
    path = tmp_path_factory.mktemp(f"window-{arch}")
    if arch.startswith("gemma"):
        make_model(path, "gemma-tiny", arch, seed=3)
    else:
        make_model(path, "tiny", arch, seed=2, sliding_window=WINDOW, tie_word_embeddings=False)
    short = prompt_ids(str(path))
    # 30-90 tokens: every text in turn, each prompt starting at another.
    long = [
        list(itertools.islice(itertools.cycle(itertools.chain(*short[i:], *short[:i])), n))
        for i, n in enumerate((30, 57, 90))
    ]
    prompts = short + long
    expected = [hf_greedy(str(path), ids, MAX_NEW) for ids in prompts]
    return arch, str(path), prompts, expected


def _run(path: str, prompts: list[list[int]], **engine_args: object) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=path, dtype="float32", **engine_args)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    return llm, [o.outputs[0].token_ids for o in outs]


def _balanced(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.check_block_accounting()


def test_prompts_run_past_the_window(family) -> None:
    prompts = family[2]
    assert max(len(p) for p in prompts) >= 7 * WINDOW
    assert sum(len(p) + MAX_NEW > WINDOW for p in prompts) >= 10


def test_batched_greedy_equals_transformers(family) -> None:
    _, path, prompts, expected = family
    llm, got = _run(path, prompts, block_size=4, num_kv_blocks=512, max_num_seqs=32)
    assert got == expected
    _balanced(llm)


def test_greedy_equals_transformers_under_preemption(family) -> None:
    _, path, prompts, expected = family
    # 40 blocks of 4 tokens cannot hold every sequence at once (Mistral's sequences
    # hold at most 4 blocks each once they run: still too many for 17 of them).
    llm, got = _run(
        path, prompts, block_size=4, num_kv_blocks=40, max_model_len=120, max_num_seqs=17,
        max_num_batched_tokens=120,
    )  # fmt: skip
    assert got == expected
    assert llm.stats().num_preemptions > 0
    _balanced(llm)


def test_greedy_equals_transformers_with_chunked_prefill(family) -> None:
    _, path, prompts, expected = family
    llm, got = _run(path, prompts, block_size=8, num_kv_blocks=256, max_num_batched_tokens=7)
    assert got == expected
    _balanced(llm)


def test_greedy_equals_transformers_behind_cached_prefixes(family) -> None:
    """Prompts sharing a 40-token prefix (over three windows), one at a time, then all at
    once: later ones start from the cached blocks (the families with a global layer keep
    every block; those windowed on every layer free them as the first holder slides, so
    fewer hit)."""
    arch, path, prompts, _ = family
    shared = prompts[-1][:40]
    tails = [[5, 6, 7], [9] * 30, [11, 12], prompts[2]]
    cached_prompts = [[*shared, *t] for t in tails]
    expected = [hf_greedy(path, ids, MAX_NEW) for ids in cached_prompts]
    for engine_args in ({"max_num_seqs": 1}, {"max_num_batched_tokens": 16}):
        llm, got = _run(
            path, cached_prompts, block_size=4, num_kv_blocks=256, enable_prefix_caching=True,
            **engine_args,
        )  # fmt: skip
        assert got == expected, engine_args
        _balanced(llm)
        if arch not in EVERY_LAYER and "max_num_seqs" in engine_args:
            assert llm.stats().prefix_cache_hits >= 3 * 36


@pytest.mark.parametrize("path_kind", ["reference", "C decode, reference chunks"])
def test_greedy_equals_transformers_through_the_reference(family, monkeypatch, path_kind) -> None:
    from pagefleet.kernels import cpu_paged_decode, cpu_paged_prefill

    _, path, prompts, expected = family
    monkeypatch.setattr(cpu_paged_prefill, "supports", lambda query, k_cache: False)
    if path_kind == "reference":
        monkeypatch.setattr(cpu_paged_decode, "supports", lambda query, k_cache: False)
    llm, got = _run(path, prompts, block_size=4, num_kv_blocks=512, max_num_batched_tokens=33)
    assert got == expected
    _balanced(llm)


def test_a_windowed_model_frees_blocks_as_it_slides(family, monkeypatch) -> None:
    """Every layer windowed (Mistral, Mixtral, Phi-3): once its 90-token prompt is
    computed, a sequence holds at most ceil(12 / 4) + 1 blocks; with a global layer
    nothing is freed."""
    from pagefleet.engine.block_manager import BlockManager

    arch, path, prompts, expected = family
    held: list[int] = []
    slide = BlockManager.free_out_of_window

    def recorded(self: BlockManager, seq) -> int:
        freed = slide(self, seq)
        held.append(len(seq.block_table) - seq.num_freed_blocks)
        return freed

    monkeypatch.setattr(BlockManager, "free_out_of_window", recorded)
    llm, got = _run(path, [prompts[-1]], block_size=4, num_kv_blocks=64)
    assert got == [expected[-1]]
    assert len(held) == MAX_NEW  # one update per step: the prompt, then 23 decodes
    if arch in EVERY_LAYER:
        assert max(held) == -(-WINDOW // 4) + 1
    else:
        assert held[-1] == -(-(90 + MAX_NEW - 1) // 4)
    _balanced(llm)


def test_the_window_changes_transformers_tokens(family) -> None:
    """The oracle sees the window: without it, transformers' tokens differ (so the tests
    above would catch a kernel reading past it)."""
    import torch
    from transformers import AutoModelForCausalLM

    arch, path, prompts, expected = family
    if arch not in EVERY_LAYER:
        pytest.skip("the families windowed on every layer suffice")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None)
    with torch.inference_mode():
        ids = prompts[-1]
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW, do_sample=False,
        )  # fmt: skip
    assert out[0, len(ids) :].tolist() != expected[-1]


def test_two_ranks_equal_transformers(family) -> None:
    """Tensor parallelism (two ranks over gloo) on a sliding-window family: Gemma 2 (its
    soft-caps and q-scaling on each rank's heads) and Mistral (blocks freed as it slides)."""
    arch, path, prompts, expected = family
    if arch not in ("gemma2", "mistral"):
        pytest.skip("two families suffice")
    with LLM(
        model=path, dtype="float32", tensor_parallel_size=2, block_size=4, num_kv_blocks=256
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outs] == expected
        _balanced(llm)
