"""Structured outputs: every sampled output obeys its constraint, on a model that knows nothing.

The tiny checkpoint has random weights: unconstrained, it emits token soup
(the same seeds without the constraint give no valid JSON at all, which
shows the grammar did the work). Sampled at temperature 1.0 under a
constraint, every one of 50 seeds must still give output that parses and
validates. A random model never chooses to close a string or an array, so
every schema here bounds its strings and arrays (maxLength / maxItems) and
its numbers, and JSON is generated compact (the engine's default: no
whitespace between tokens, else a random model may emit whitespace for
ever); max_tokens is set well above the longest output the schemas allow
so that every output ends because its grammar is complete ("stop"), never
by length. The 50 seeds of every constraint go in one generate call.

Every test that drives an engine ends with the block pool balanced.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagefleet.engine import (
    LLM,
    InvalidRequestError,
    SamplingParams,
    StepFailedError,
    StructuredOutputsParams,
    validate_structured_outputs,
)
from pagefleet.engine.core_messages import AddRequest, CoreEvents
from pagefleet.engine.engine_core import EngineCore
from pagefleet.engine.sampler import apply_grammar_bitmask

SEEDS = range(50)
MAX_TOKENS = 160

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
            # Optional properties: present or not, each valid.
            "rank": {"type": ["integer", "null"], "minimum": 0, "maximum": 50},
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 3},
                "maxItems": 2,
            },
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "version": {"const": 3},
        },
        "required": ["color", "size", "version"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
        },
        "required": ["x", "n"],
        "additionalProperties": False,
    },
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ("yes", "no", "maybe so")


def _constrained(so: StructuredOutputsParams, seed: int, **kw: object) -> SamplingParams:
    kw = {"temperature": 1.0, "max_tokens": MAX_TOKENS, **kw}
    return SamplingParams(seed=seed, structured_outputs=so, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    llm = LLM(model=llama_dir, num_kv_blocks=2048, block_size=16, max_num_seqs=256)
    yield llm
    llm.check_block_accounting()


def test_every_seed_obeys_its_constraint(llm: LLM) -> None:
    cases: list[tuple[str, StructuredOutputsParams]] = [
        *((name, StructuredOutputsParams(json=schema)) for name, schema in SCHEMAS.items()),
        ("regex", StructuredOutputsParams(regex=REGEX)),
        ("choice", StructuredOutputsParams(choice=CHOICES)),
        ("json_object", StructuredOutputsParams(json_object=True)),
    ]
    # json_object (any object) is unbounded for a random model: a few tokens of a few
    # seeds are enough to check that it starts as one; it is not required to finish.
    params = [
        _constrained(so, seed, **({"max_tokens": 4} if name == "json_object" else {}))
        for name, so in cases
        for seed in SEEDS
    ]
    before = llm.stats()
    outs = llm.generate(["The answer:"] * len(params), params, use_tqdm=False)
    for k, (name, _) in enumerate(cases):
        for out in outs[k * len(SEEDS) : (k + 1) * len(SEEDS)]:
            sample = out.outputs[0]
            text = sample.text
            if name == "json_object":
                assert text.startswith("{"), text
                continue
            assert sample.finish_reason == "stop", (name, text)
            if name == "regex":
                assert re.fullmatch(REGEX, text), text
            elif name == "choice":
                assert text in CHOICES, text
            else:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
    after = llm.stats()
    assert after.grammar_cache_misses - before.grammar_cache_misses == len(cases)
    assert after.grammar_compiles - before.grammar_compiles == len(cases)
    assert after.grammar_cache_hits - before.grammar_cache_hits == len(cases) * (len(SEEDS) - 1)
    assert after.grammar_compile_seconds > before.grammar_compile_seconds
    llm.check_block_accounting()


def test_without_the_constraint_the_same_seeds_give_no_json(llm: LLM) -> None:
    # 24 tokens are enough to be valid (most constrained outputs are shorter) and to fail.
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24) for s in SEEDS]
    outs = llm.generate(["The answer:"] * len(params), params, use_tqdm=False)
    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["nested"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid == 0
    llm.check_block_accounting()


def test_n_and_best_of_samples_each_obey_the_constraint(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMAS["nested"])
    params = [
        _constrained(so, 7, n=4),
        _constrained(so, 8, n=2, best_of=4),
        # A one-token prompt: the samples start apart (no fork after the prompt).
        _constrained(StructuredOutputsParams(regex=REGEX), 9, n=3),
    ]
    outs = llm.generate(["The answer:", "The answer:", [5]], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [4, 2, 3]
    for out in outs[:2]:
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            jsonschema.validate(json.loads(sample.text), SCHEMAS["nested"])
    assert len({c.text for c in outs[0].outputs}) > 1  # the samples advanced apart
    assert all(re.fullmatch(REGEX, c.text) for c in outs[2].outputs)
    llm.check_block_accounting()


def test_preemption_keeps_each_sequence_on_its_grammar(llama_dir: str) -> None:
    schema = {
        "type": "array",
        "items": {"type": "string", "minLength": 4, "maxLength": 8},
        "minItems": 6,
        "maxItems": 8,
    }
    so = StructuredOutputsParams(json=schema)
    # 8 sequences of ~40-80 tokens in 48 blocks of 4 tokens: they cannot all fit.
    llm = LLM(model=llama_dir, num_kv_blocks=48, block_size=4, max_num_seqs=8)
    outs = llm.generate(
        ["The answer:"] * 8, [_constrained(so, s) for s in range(8)], use_tqdm=False
    )
    assert llm.stats().num_preemptions > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    llm.check_block_accounting()
    llm.close()


def test_chunked_prefill_samples_only_at_the_prompt_end(llama_dir: str) -> None:
    llm = LLM(
        model=llama_dir,
        num_kv_blocks=128,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    long_prompt = list(range(10, 70))  # 60 tokens: four chunks before the first sample
    so = StructuredOutputsParams(json=SCHEMAS["enums"])
    outs = llm.generate([long_prompt, [5, 6]], [_constrained(so, 1), _constrained(so, 2)], False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["enums"])
    llm.check_block_accounting()
    llm.close()


def test_the_grammar_cache_is_exact(llm: LLM) -> None:
    engine = llm.engine
    schema = {**SCHEMAS["enums"], "title": "cache"}  # compiled by no other test
    reordered = dict(reversed(schema.items()))  # the same schema, keys in another order
    before = engine.stats()

    def moved() -> tuple[int, int, int]:
        now = engine.stats()
        return (
            now.grammar_cache_misses - before.grammar_cache_misses,
            now.grammar_cache_hits - before.grammar_cache_hits,
            now.grammar_compiles - before.grammar_compiles,
        )

    for i in range(5):
        engine.add_request(f"r{i}", "x", _constrained(StructuredOutputsParams(json=schema), i))
    engine.add_request("o", "x", _constrained(StructuredOutputsParams(json=reordered), 9))
    assert moved()[:2] == (2, 4)
    stats = engine.stats()
    assert stats.num_waiting == 6 and stats.num_used_blocks == 0  # waiting for the grammar
    while engine.has_unfinished_requests():
        engine.step()
    assert moved() == (2, 4, 2)
    engine.add_request("late", "x", _constrained(StructuredOutputsParams(json=schema), 10))
    assert moved() == (2, 5, 2)
    while engine.has_unfinished_requests():
        engine.step()
    llm.check_block_accounting()


@pytest.mark.parametrize(
    ("so", "named"),
    [
        (StructuredOutputsParams(regex="a(b"), "invalid regex: "),
        (StructuredOutputsParams(grammar="start: missing_rule"), "invalid grammar: "),
        (StructuredOutputsParams(json={"type": "nonsense"}), "invalid JSON schema: "),
        (StructuredOutputsParams(json={"$ref": "#/nowhere"}), "invalid JSON schema: "),
        (StructuredOutputsParams(json=False), "invalid JSON schema: "),
    ],
)
def test_a_rejected_constraint_fails_before_queueing(
    llm: LLM, so: StructuredOutputsParams, named: str
) -> None:
    engine = llm.engine
    message = validate_structured_outputs(so)  # what an ingress calls: torch-free
    assert message is not None and message.startswith(f"structured outputs: {named}")
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        engine.add_request("bad", "x", _constrained(so, 0))
    assert "bad" not in engine.token_engine and not engine.has_unfinished_requests()
    assert engine.stats().num_used_blocks == 0 and engine.stats().num_waiting == 0
    # Through the engine core: rejected as the caller's input.
    events = CoreEvents()
    EngineCore(engine).apply([AddRequest("bad", "x", _constrained(so, 0))], events)
    assert [(r.error, r.message) for r in events.rejected] == [("InvalidRequestError", message)]
    llm.check_block_accounting()


def test_a_grammar_refused_by_the_vocabulary_fails_its_request_alone(llm: LLM) -> None:
    # Valid Lark, but token 5000 is past the tiny model's 1024: only the compile sees it.
    so = StructuredOutputsParams(grammar="start: <[5000]>")
    assert validate_structured_outputs(so) is None
    engine = llm.engine
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("good", "x", ok)
    engine.add_request("bad", "x", _constrained(so, 0))
    failed, done = [], {}
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                done[out.request_id] = out
        except StepFailedError as e:
            failed += e.request_ids
            assert isinstance(e.__cause__, InvalidRequestError)
            assert "Token range end too large: 5000" in str(e.__cause__)
    assert failed == ["bad"] and done["good"].finished
    llm.check_block_accounting()
    # The engine core reports it as the caller's input, not an engine failure.
    core = EngineCore(llm.engine)
    events = CoreEvents()
    core.apply([AddRequest("bad2", "x", _constrained(so, 0))], events)  # cached: fails at once
    while not events.failed:
        core.step(events)
    assert [(r.request_id, r.error) for r in events.failed] == [("bad2", "InvalidRequestError")]
    llm.check_block_accounting()


def test_an_unconstrained_request_is_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["import os"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    so = StructuredOutputsParams(json=SCHEMAS["nested"])
    mixed = llm.generate(
        ["The answer:", "import os", "x", "import os"],
        [_constrained(so, 1), greedy, _constrained(so, 2), _constrained(so, 3)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[3].outputs[0].token_ids != alone  # the same prompt, constrained
    llm.check_block_accounting()


def test_stop_strings_still_end_a_constrained_sample(llm: LLM) -> None:
    so = StructuredOutputsParams(regex="[ab]{40}")
    outs = llm.generate(
        ["x"] * 20, [_constrained(so, s, stop="b") for s in range(20)], use_tqdm=False
    )
    for out in outs:
        sample = out.outputs[0]
        assert (sample.finish_reason, sample.stop_reason) == ("stop", "b")
        assert set(sample.text) <= {"a"}
    llm.check_block_accounting()


def test_logprobs_are_the_raw_models(llm: LLM) -> None:
    # One choice: the grammar allows exactly one token at each step, so post-mask
    # logprobs would all be 0; reported ones are the model's own, before the mask.
    so = StructuredOutputsParams(choice=["zebra"])
    out = llm.generate(["x"], _constrained(so, 0, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.text == "zebra"
    first = out.logprobs[0]
    assert first[out.token_ids[0]] < -0.01
    assert len(first) >= 3  # the model's top 3 (the grammar allows none of them but one)
    llm.check_block_accounting()


def test_min_tokens_and_ignore_eos_do_not_hold_a_complete_grammar_open(llm: LLM) -> None:
    so = StructuredOutputsParams(choice=CHOICES)
    params = [
        _constrained(so, 0, min_tokens=20),
        _constrained(so, 1, ignore_eos=True),
    ]
    for out in llm.generate(["x", "x"], params, use_tqdm=False):
        sample = out.outputs[0]
        assert sample.text in CHOICES and sample.finish_reason == "stop"
        assert len(sample.token_ids) < 20
    llm.check_block_accounting()


def test_beam_search_refuses_a_constrained_sequence(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("c", [5, 6], _constrained(StructuredOutputsParams(regex="a{30}"), 0))
    seq = engine.token_engine.sequences("c")[0]
    while seq.num_output_tokens == 0:  # compiled, admitted, sampled once
        engine.step()
    assert seq.grammar is not None
    with pytest.raises(ValueError, match="beam search does not support structured outputs"):
        engine.token_engine.replace_last_token("c", 0, 7)
    engine.abort_request("c")
    llm.check_block_accounting()


def test_the_bitmask_masks_exactly_the_disallowed_tokens_of_its_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=gen)  # [rows, vocab]: 70 tokens, 3 words
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 2), dtype=torch.int32, generator=gen)
    masked = logits.clone()
    apply_grammar_bitmask(masked, [1, 3], bitmask)  # two words: tokens 64-69 not allowed
    for row in (0, 2):
        assert torch.equal(masked[row], logits[row])
    for i, row in enumerate((1, 3)):
        words = [w & 0xFFFFFFFF for w in bitmask[i].tolist()]
        for t in range(70):
            allowed = t < 64 and (words[t // 32] >> (t % 32)) & 1
            assert masked[row, t].item() == (logits[row, t].item() if allowed else float("-inf"))


def test_aborting_a_request_whose_grammar_is_compiling_leaves_nothing(llm: LLM) -> None:
    engine = llm.engine
    so = StructuredOutputsParams(json={**SCHEMAS["nested"], "title": "abort"})  # uncompiled
    engine.add_request("a", [5], _constrained(so, 0, n=2))  # one token: two sequences at once
    assert engine.has_unfinished_requests() and engine.stats().num_waiting == 2
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and "a" not in engine.token_engine
    assert engine.step_deltas() == []
    llm.check_block_accounting()
