"""LLMEngine: request lifecycle, aborts, validation, stats, incremental detokenization."""

from __future__ import annotations

import pytest

from pagefleet.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pagefleet.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import tokenizer_for


@pytest.fixture()
def engine(llama_dir: str) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=40, block_size=4, max_num_seqs=3))
    yield eng
    eng.check_block_accounting()


def test_abort_running_and_waiting_requests_frees_their_blocks(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", "for item in items:", params)
    engine.step()
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 3 and stats.num_waiting == 2
    assert 0 < stats.kv_cache_usage < 1
    used_before = stats.num_used_blocks
    engine.abort_request("r1")  # running
    engine.abort_request(["r4", "missing"])  # waiting, unknown
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 1
    assert stats.num_used_blocks < used_before
    engine.token_engine.block_manager.check_accounting()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["r0", "r2", "r3"]
    assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
    assert engine.stats().num_free_blocks == 40


def test_step_outputs_stream_new_tokens(engine: LLMEngine) -> None:
    engine.add_request(
        "s", "import os", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    streamed_ids, streamed_text, last = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed_ids += out.outputs[0].new_token_ids
            streamed_text += out.outputs[0].new_text
            last = out
    assert last is not None and last.finished
    assert streamed_ids == last.outputs[0].token_ids and len(streamed_ids) == 5
    assert streamed_text == last.outputs[0].text
    assert engine.stats().generation_tokens_total == 5
    assert engine.stats().prompt_tokens_total == len(last.prompt_token_ids)


def test_duplicate_request_id_is_refused(engine: LLMEngine) -> None:
    engine.add_request("dup", "x", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "y", SamplingParams(max_tokens=2))
    engine.abort_request("dup")


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 5000]}, "integers in"),
        ({"prompt_token_ids": [1, -1]}, "integers in"),
        ({"prompt_token_ids": list(range(1, 200))}, "at most"),
        (3.5, "a prompt is"),
    ],
)
def test_bad_prompts_raise_before_anything_is_queued(
    llama_dir: str, prompt: object, message: str
) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=16, block_size=8, max_model_len=128)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.check_block_accounting()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(max_tokens=0),
        dict(min_tokens=5, max_tokens=2),
        dict(presence_penalty=3.0),
        dict(frequency_penalty=-2.5),
        dict(repetition_penalty=0.0),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
    ],
)
def test_bad_sampling_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=3), "block_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(num_kv_blocks=4, kv_cache_memory_bytes=100), "at most one"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(device="tpu"), "device"),
    ],
)
def test_bad_engine_config_raises(llama_dir: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=llama_dir, **kwargs)


def test_missing_model_dir_raises(tmp_path) -> None:
    with pytest.raises(ValueError, match="make-model"):
        EngineConfig(model=str(tmp_path / "nope"))


def test_capacity_from_memory_budget_and_limits(llama_dir: str) -> None:
    # tiny: 2 layers x K and V x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes per token.
    eng = LLMEngine(
        EngineConfig(model=llama_dir, kv_cache_memory_bytes=512 * 16 * 10, block_size=16)
    )
    assert eng.capacity.num_kv_blocks == 10
    assert eng.capacity.kv_bytes_per_block == 512 * 16
    assert eng.capacity.max_model_len == 160  # lowered to what the cache holds
    with pytest.raises(ValueError, match="larger than the KV cache"):
        LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=2, block_size=16, max_model_len=64))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=llama_dir, max_model_len=100_000))
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        LLMEngine(
            EngineConfig(
                model=llama_dir,
                num_kv_blocks=64,
                max_model_len=512,
                max_num_batched_tokens=128,
                enable_chunked_prefill=False,
            )
        )


def test_generation_stops_at_max_model_len(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=8, block_size=4, max_model_len=20)
    ids = list(range(10, 25))  # 15 tokens: room for 5 more
    out = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"
    llm.check_block_accounting()


def test_incremental_detokenizer_handles_multibyte_characters(llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    text = "naïve café → 世界 🎉 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    prompt = tok.encode("x = ")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    pieces = [detok.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)  # ends on a whole character: nothing held back


def test_demand_blocks_count_what_unfinished_requests_still_need(engine: LLMEngine) -> None:
    # block_size 4; prompts given as token ids so the arithmetic is exact.
    engine.add_request("long", {"prompt_token_ids": [5] * 6}, SamplingParams(max_tokens=20))
    engine.add_request("short", {"prompt_token_ids": [6] * 3}, SamplingParams(max_tokens=1))
    engine.add_request("pair", {"prompt_token_ids": [7] * 5}, SamplingParams(max_tokens=8, n=2))
    # Waiting, nothing allocated: ceil(26/4) + ceil(4/4) + ceil(13/4) + 1 fork x ceil(8/4).
    assert engine.stats().num_demand_blocks == 7 + 1 + 4 + 2
    engine.step()
    sched = engine.token_engine.scheduler
    # "short" finished; "long" holds 2 blocks (7 tokens) of its 7; "pair" still waits.
    assert [s.request_id for s in sched.running] == ["long"]
    assert [s.request_id for s in sched.waiting] == ["pair"]
    assert len(sched.running[0].block_table) == 2
    assert engine.stats().num_demand_blocks == (7 - 2) + (4 + 2)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_demand_blocks == 0


def test_demand_blocks_count_a_shared_prompt_prefix_once(engine: LLMEngine) -> None:
    # block_size 4: a 12-token system prompt is 3 full blocks.
    system, other = list(range(100, 112)), list(range(200, 212))
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("first", {"prompt_token_ids": [*system, 1, 2]}, p)
    engine.step()  # "first" runs: 15 tokens in 4 blocks, the system prompt's 3 cached
    assert len(engine.token_engine.sequences("first")[0].block_table) == 4
    engine.add_request("a", {"prompt_token_ids": [*system, 3, 4]}, p)
    engine.add_request("b", {"prompt_token_ids": [*system, 5, 6, 7]}, p)
    engine.add_request("c", {"prompt_token_ids": [*other, 1, 2]}, p)
    engine.add_request("d", {"prompt_token_ids": [*other, 3, 4]}, p)
    # first: ceil(18/4) - 4 held = 1. a, b: 5 blocks each, of which "first" holds the 3 of
    # the system prompt: 2 each. c: all 5 (nobody holds its prefix yet); d: 2, since c
    # will have computed the shared 3 by then. Counting every prompt whole would say 21.
    assert engine.stats().num_demand_blocks == 1 + 2 + 2 + 5 + 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_demand_blocks == 0


def test_busy_budget_seconds_weigh_each_step_by_its_token_budget_share(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EngineStats.busy_budget_seconds`: each step's duration times the share of
    max_num_batched_tokens it scheduled. A clock that moves 1 s per reading makes each
    step last exactly 1 s (its start and end readings)."""
    ticks = iter(range(1_000_000))
    tokens = engine.token_engine
    monkeypatch.setattr(tokens, "clock", lambda: float(next(ticks)))
    budget = tokens.capacity.max_num_batched_tokens
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", "for item in items:", params)
    prompt = len(tokens.sequences("a")[0].token_ids)
    engine.step()  # the prompt, whole
    assert engine.stats().busy_budget_seconds == prompt / budget
    engine.step()  # one decode token
    assert engine.stats().busy_budget_seconds == (prompt + 1) / budget
    while engine.has_unfinished_requests():
        engine.step()
