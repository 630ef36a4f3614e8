"""What callers get back: text as vLLM's, outputs that never change, per-request timing.

Tokens are forced with a scripted sampler where a case needs exact tokens
(half a multi-byte character, a token that completes two stop strings).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from pagefleet.engine import EngineConfig, LLMEngine, RequestMetrics, RequestOutput, SamplingParams
from pagefleet.engine.sampler import SamplerOutput, SamplingBatch
from tests.conftest import tokenizer_for


class ScriptedSampler:
    """Stands in for the sampler: each sampling row takes the next token of the script."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        rows = len(batch.params)
        tokens = [self.script.pop(0) for _ in range(rows)]
        return SamplerOutput(tokens, [None] * rows, [None] * rows)


@pytest.fixture()
def engine(llama_dir: str) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=4, max_num_seqs=2))
    yield eng
    eng.check_block_accounting()


def tok_id(llama_dir: str, token: str) -> int:
    return tokenizer_for(llama_dir).convert_tokens_to_ids(token)


def run_scripted(
    engine: LLMEngine, script: list[int], params: SamplingParams
) -> tuple[list[RequestOutput], RequestOutput]:
    """Run one request whose tokens are `script`; (every output, deep-copied when made; last)."""
    engine.token_engine.runner.sampler = ScriptedSampler(script)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    seen: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        seen += [copy.deepcopy(o) for o in engine.step()]
    return seen, seen[-1]


def streamed(outs: list[RequestOutput]) -> str:
    return "".join(o.outputs[0].new_text for o in outs)


# -- text at the end of a sample, as vLLM's detokenizer leaves it -----------------


def test_stop_token_after_half_a_character_holds_the_bytes_back(
    engine: LLMEngine, llama_dir: str
) -> None:
    x, lead, stop = tok_id(llama_dir, "x"), tok_id(llama_dir, "Ã"), tok_id(llama_dir, "def")
    outs, last = run_scripted(
        engine, [x, lead, stop], SamplingParams(max_tokens=10, stop_token_ids=[stop])
    )
    comp = last.outputs[0]
    # vLLM: the stop token is not decoded, and the lone lead byte 0xC3 is never emitted.
    assert comp.text == "x" and streamed(outs) == "x"
    assert comp.token_ids == [x, lead, stop]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert [o.outputs[0].new_text for o in outs] == ["x", "", ""]


def test_kept_stop_token_after_half_a_character_decodes_as_vllm(
    engine: LLMEngine, llama_dir: str
) -> None:
    x, lead, stop = tok_id(llama_dir, "x"), tok_id(llama_dir, "Ã"), tok_id(llama_dir, "def")
    outs, last = run_scripted(
        engine,
        [x, lead, stop],
        SamplingParams(max_tokens=10, stop_token_ids=[stop], include_stop_str_in_output=True),
    )
    # The stop token is decoded; the byte before it can no longer complete a character.
    assert last.outputs[0].text == "x\ufffddef" == streamed(outs)


def test_length_finish_on_half_a_character_holds_the_bytes_back(
    engine: LLMEngine, llama_dir: str
) -> None:
    x, lead = tok_id(llama_dir, "x"), tok_id(llama_dir, "Ã")
    outs, last = run_scripted(engine, [x, x, lead], SamplingParams(max_tokens=3))
    assert last.outputs[0].text == "xx" == streamed(outs)
    assert last.outputs[0].finish_reason == "length"


def test_eos_is_not_decoded_even_when_special_tokens_are_kept(
    engine: LLMEngine, llama_dir: str
) -> None:
    x, eos = tok_id(llama_dir, "x"), next(iter(engine.token_engine.eos_ids))
    _, last = run_scripted(
        engine, [x, eos], SamplingParams(max_tokens=5, skip_special_tokens=False)
    )
    assert last.outputs[0].text == "x"
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", None)


# -- stop strings ----------------------------------------------------------------------


def test_of_two_stop_strings_in_one_token_the_first_to_end_wins(
    engine: LLMEngine, llama_dir: str
) -> None:
    x, d = tok_id(llama_dir, "x"), tok_id(llama_dir, "def")
    _, last = run_scripted(engine, [x, d, x], SamplingParams(max_tokens=3, stop=["def", "de"]))
    # "de" ends before "def" does, as if the text came a character at a time.
    assert (last.outputs[0].text, last.outputs[0].stop_reason) == ("x", "de")
    assert last.outputs[0].token_ids == [x, d]


def test_stop_string_counts_only_after_min_tokens(engine: LLMEngine, llama_dir: str) -> None:
    x, d = tok_id(llama_dir, "x"), tok_id(llama_dir, "def")
    params = SamplingParams(max_tokens=5, min_tokens=2, stop=["def"])
    _, last = run_scripted(engine, [x, d, x, d, x], params)
    # The 2nd token completes "def" but only the 3rd and later may stop (vLLM's rule).
    assert (last.outputs[0].text, last.outputs[0].stop_reason) == ("xdefx", "def")
    assert last.outputs[0].token_ids == [x, d, x, d]


def test_kept_stop_string_is_streamed_without_holdback(engine: LLMEngine, llama_dir: str) -> None:
    x, d = tok_id(llama_dir, "x"), tok_id(llama_dir, "def")
    params = SamplingParams(max_tokens=5, stop=["xxdef"], include_stop_str_in_output=True)
    outs, last = run_scripted(engine, [x, x, x, d, x], params)
    assert [o.outputs[0].new_text for o in outs] == ["x", "x", "x", "def"]
    assert [o.outputs[0].text for o in outs] == ["x", "xx", "xxx", "xxxdef"]
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", "xxdef")


def test_cut_stop_string_is_held_back_while_streaming(engine: LLMEngine, llama_dir: str) -> None:
    x, d = tok_id(llama_dir, "x"), tok_id(llama_dir, "def")
    outs, last = run_scripted(engine, [x, x, x, d, x], SamplingParams(max_tokens=5, stop=["xdef"]))
    # 3 characters held back; a streamed output's text is never more than was streamed.
    assert [o.outputs[0].text for o in outs] == ["", "", "", "xx"]
    assert [o.outputs[0].new_text for o in outs] == ["", "", "", "xx"]
    assert last.outputs[0].stop_reason == "xdef"


# -- outputs are the caller's ---------------------------------------------------------


def test_yielded_outputs_never_change_and_do_not_alias_the_engine(llama_dir: str) -> None:
    engine = LLMEngine(
        EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=4, max_num_batched_tokens=4)
    )
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1, n=2)
    prompt = list(range(10, 19))  # 9 tokens: prompt logprobs arrive over chunks of 4

    def run(tamper: bool) -> list[tuple[RequestOutput, RequestOutput]]:
        engine.add_request("a", {"prompt_token_ids": prompt}, params)
        pairs = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                pairs.append((out, copy.deepcopy(out)))
                if tamper:  # a caller scribbling on its output must not reach the engine
                    out.prompt_token_ids.append(999)
                    out.prompt_logprobs.append({1: 0.0})
                    for c in out.outputs:
                        c.token_ids.append(999)
                        c.logprobs.append({1: 0.0})
        engine.check_block_accounting()
        return pairs

    clean = run(tamper=False)
    assert len(clean) == 6
    for out, snapshot in clean:
        assert out == snapshot  # as it was when yielded
    tampered = run(tamper=True)

    def untimed(pairs: list[tuple[RequestOutput, RequestOutput]]) -> list[RequestOutput]:
        return [dataclasses.replace(snap, metrics=None) for _, snap in pairs]

    assert untimed(tampered) == untimed(clean)


# -- timing ----------------------------------------------------------------------


def test_request_metrics_mark_each_milestone(llama_dir: str) -> None:
    # One sequence at a time: "b" waits in the queue until "a" is done.
    engine = LLMEngine(
        EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=4, max_num_seqs=1)
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", "import os", params)
    engine.add_request("b", "import sys", params)
    outs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    engine.check_block_accounting()
    for rid in ("a", "b"):
        ms = [o.metrics for o in outs[rid]]
        assert all(isinstance(m, RequestMetrics) for m in ms) and len(ms) == 3
        first = ms[0]
        assert first.arrival_time <= first.first_scheduled_time <= first.first_token_time
        assert first.first_token_time == first.last_token_time
        assert {m.first_token_time for m in ms} == {first.first_token_time}
        assert {m.first_scheduled_time for m in ms} == {first.first_scheduled_time}
        assert ms[0].last_token_time < ms[1].last_token_time < ms[2].last_token_time
        assert [m.finished_time for m in ms] == [None, None, ms[2].last_token_time]
        assert ms[2].e2e_latency == ms[2].finished_time - ms[2].arrival_time
    a_done, b = outs["a"][-1].metrics, outs["b"][-1].metrics
    assert b.first_scheduled_time > a_done.finished_time  # queued behind "a"
    assert b.queue_time == b.first_scheduled_time - b.arrival_time
    assert outs["a"][0].metrics.finished_time is None  # later steps did not reach it
