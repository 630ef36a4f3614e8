"""Constraint bombs and prefix-cache isolation, at the engine's level.

- A counted repetition nested in another (`(a{1000}){1000}`) is refused by the check
  against the vocabulary and by the compile, under llguidance's limits: the engine
  fails the request before it is scheduled, keeps no matcher for it, and its memory
  stays where it was across 20 distinct such requests.
- The grammar cache is bounded by bytes as well as entries.
- Choices are one Lark terminal, an alternation of escaped literals: every choice,
  metacharacters included, is matched exactly.
- A compile error is reported by its first meaningful line (never a backtrace's end).
- `cache_salt` roots a prompt's block hash chain: salted prompts share cached blocks
  only with the same salt.
"""

from __future__ import annotations

import pytest
from llguidance import LLMatcher, LLTokenizer

from pagefleet.engine import (
    LLM,
    ConstraintValidator,
    InvalidRequestError,
    SamplingParams,
    StepFailedError,
    StructuredOutputsParams,
    block_hashes,
    salted,
)
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.grammar_compiler import GrammarCompiler
from pagefleet.engine.grammar_spec import (
    choice_lark,
    describe,
    grammar_spec,
    ll_tokenizer,
    validate,
)
from pagefleet.engine.sequence import Sequence
from tests.conftest import tokenizer_for

BOMB = "(a{1000}){1000}"
TINY_VOCAB = 1024
MB = 1024 * 1024


def bomb(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"(a{{1000}}){{{1000 + i}}}")


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def vocabulary(llama_dir: str) -> LLTokenizer:
    tok = tokenizer_for(llama_dir)
    return ll_tokenizer(tok.backend_tokenizer.to_str(), TINY_VOCAB, [tok.eos_token_id])


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    llm = LLM(model=llama_dir, num_kv_blocks=256, block_size=16, max_num_seqs=16)
    yield llm
    llm.check_block_accounting()


def test_a_nested_repetition_is_refused_against_the_vocabulary(vocabulary: LLTokenizer) -> None:
    message = validate(StructuredOutputsParams(regex=BOMB), vocabulary)
    assert (
        message
        == "structured outputs: invalid regex: lexer error: too many expressions constructed"
    )
    # Without the vocabulary only the syntax is checked; ordinary regexes pass both.
    assert validate(StructuredOutputsParams(regex=BOMB)) is None
    for regex in (r"[a-z]{1,20}@[a-z]{2,10}\.(com|org)", r"\d{3}-\d{4}", "(ab|cd){1000}"):
        assert validate(StructuredOutputsParams(regex=regex), vocabulary) is None


def test_the_verdicts_are_cached_by_constraint(llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    validator = ConstraintValidator(workers=2)
    try:
        validator.set_vocabulary(tok.backend_tokenizer.to_str(), TINY_VOCAB, [tok.eos_token_id])
        first = validator.submit(StructuredOutputsParams(regex=BOMB))
        assert validator.submit(StructuredOutputsParams(regex=BOMB)) is first
        assert first.result(timeout=120) == (
            "structured outputs: invalid regex: lexer error: too many expressions constructed"
        )
        validator.forget(StructuredOutputsParams(regex=BOMB))  # done: its verdict stays
        assert validator.submit(StructuredOutputsParams(regex=BOMB)) is first
    finally:
        validator.close()


def test_twenty_distinct_bombs_fail_at_compile_and_leave_memory_flat(llm: LLM) -> None:
    engine = llm.engine
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", "x", SamplingParams(max_tokens=2, structured_outputs=bomb(-1)))
    failed: list[str] = []
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except StepFailedError as e:
            failed += e.request_ids
    before = resident()
    for i in range(20):
        engine.add_request(f"good-{i}", "x", ok)
        params = SamplingParams(max_tokens=2, structured_outputs=bomb(i))
        engine.add_request(f"bomb-{i}", "x", params)  # syntax passes: the compile refuses
        while engine.has_unfinished_requests():
            try:
                engine.step()
            except StepFailedError as e:
                failed += e.request_ids
                assert isinstance(e.__cause__, InvalidRequestError)
                assert str(e.__cause__) == (
                    "structured outputs: invalid regex: lexer error: too many expressions "
                    "constructed"
                )
    assert failed == ["warm"] + [f"bomb-{i}" for i in range(20)]
    assert resident() - before < 150 * MB
    assert engine.token_engine.grammars.cached_bytes == 0  # failures cache no matcher
    llm.check_block_accounting()


def test_the_grammar_cache_is_bounded_by_bytes(llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    regexes = [f"[a-z]{{{n}}}x" for n in (3, 4, 5)]
    tight = GrammarCompiler(tok, TINY_VOCAB, frozenset({tok.eos_token_id}), cache_bytes=1)
    roomy = GrammarCompiler(tok, TINY_VOCAB, frozenset({tok.eos_token_id}))
    try:
        for compiler in (tight, roomy):
            for regex in regexes:
                compiler.submit(StructuredOutputsParams(regex=regex)).result(timeout=120)
                compiler.submit(StructuredOutputsParams(regex=regex))  # weighed by now
        assert tight.num_cached == 1 and tight.cached_bytes > 0
        assert roomy.num_cached == 3 and roomy.cached_bytes <= roomy.cache_bytes
        # The newest stays, however much it weighs.
        newest = StructuredOutputsParams(regex=regexes[-1])
        assert tight.submit(newest).done() and tight.cache_hits == 4
    finally:
        tight.close()
        roomy.close()


def test_choices_are_one_terminal_of_escaped_literals_matched_exactly(
    llm: LLM, vocabulary: LLTokenizer
) -> None:
    choices = ["a|b", "(x)", "1.5*", "é ok", '"q"\\', "[^]"]
    so = StructuredOutputsParams(choice=choices)
    assert grammar_spec(so) == LLMatcher.grammar_from_lark(choice_lark(choices))
    assert validate(so, vocabulary) is None
    params = [SamplingParams(seed=s, max_tokens=32, structured_outputs=so) for s in range(12)]
    outs = llm.generate(["Pick:"] * len(params), params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    llm.check_block_accounting()


def test_a_compile_error_reports_its_first_meaningful_line() -> None:
    so = StructuredOutputsParams(choice=["x"])
    panic = "\n<backtrace>\n   0: llguidance::panic\n             at src/lib.rs:1\n</backtrace>"
    assert describe(so, "lexer panicked: index out of bounds" + panic) == (
        "structured outputs: invalid choice: lexer panicked: index out of bounds"
    )
    lark = 'at 1(8): unknown name: "r"\n   1 | start: r\n              ^\n'
    assert describe(so, lark) == 'structured outputs: invalid choice: at 1(8): unknown name: "r"'
    message = validate(StructuredOutputsParams(regex="a(b"))
    assert message == (
        'structured outputs: invalid regex: at 1(8): invalid regex "a(b" (in regex): regex '
        "parse error: error: unclosed group"
    )


# -- cache_salt ---------------------------------------------------------------------


def _seq(rid: str, tokens: list[int], salt: str | None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), cache_salt=salt)


def _admit(bm: BlockManager, s: Sequence) -> int:
    cached = bm.cached_prefix(s)
    assert bm.allocate_prefilled(s, cached, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return len(cached)


def test_salted_prompts_share_blocks_only_with_their_salt() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(13))  # three full blocks
    assert _admit(bm, _seq("victim", prompt, "tenant-a")) == 0
    assert _admit(bm, _seq("other", prompt, "tenant-b")) == 0
    assert _admit(bm, _seq("plain", prompt, None)) == 0
    assert _admit(bm, _seq("same", prompt, "tenant-a")) == 3
    assert _admit(bm, _seq("plain-again", prompt, None)) == 3
    bm.check_accounting()
    # The router's hashes follow: the chain a salted prompt is cached under.
    root = salted(bm.hash_salt, "tenant-a")
    assert root not in (bm.hash_salt, salted(bm.hash_salt, "tenant-b"))
    assert salted(bm.hash_salt, None) == bm.hash_salt
    victim_hashes = block_hashes(prompt, 4, root)
    assert all(bm.holds(h) for h in victim_hashes)


def test_the_engine_takes_cache_salt_in_the_prompt(llm: LLM) -> None:
    engine = llm.engine
    prompt = list(range(1, 50))  # three full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=1)
    for rid, salt in [("a", "t1"), ("b", "t2"), ("c", "t1"), ("d", None)]:
        before = engine.stats().prefix_cache_hits
        p: dict = {"prompt_token_ids": prompt}
        if salt is not None:
            p["cache_salt"] = salt
        engine.add_request(rid, p, params)
        while engine.has_unfinished_requests():
            engine.step()
        hits = engine.stats().prefix_cache_hits - before
        assert hits == {"a": 0, "b": 0, "c": 48, "d": 0}[rid], rid
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        engine.add_request("e", {"prompt_token_ids": prompt, "cache_salt": ""}, params)
    llm.check_block_accounting()
