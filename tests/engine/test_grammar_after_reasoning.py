"""A constraint with `after_token_ids` leaves the output free until those tokens (the end
of a reasoning block), then constrains what follows."""

from __future__ import annotations

from pagefleet.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import prompt_ids, tokenizer_for


def test_the_grammar_applies_after_the_reasoning_ends(llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    ids = prompt_ids(llama_dir)[3]
    with LLM(model=llama_dir, num_kv_blocks=64, block_size=8, max_model_len=128) as llm:
        free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        plain = list(llm.generate([{"prompt_token_ids": ids}], free)[0].outputs[0].token_ids)
        end = plain[3]  # the token that closes the "reasoning" here
        k = plain.index(end)
        choice = StructuredOutputsParams(choice=["yes", "no"], after_token_ids=(end,))
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=choice)
        for n in (1, 2):  # a forked sample carries the state too
            out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
            assert list(out.token_ids[: k + 1]) == plain[: k + 1]  # free until `end`
            assert tok.decode(out.token_ids[k + 1 :]) in ("yes", "no")
            assert out.finish_reason == "stop"
            params = SamplingParams(
                temperature=0, max_tokens=40, structured_outputs=choice, n=n + 1, seed=1
            )
        llm.check_block_accounting()


def test_an_optional_start_decides_on_the_first_token(llama_dir: str) -> None:
    """With `optional_start_token_id`, the first token is the grammar's or that token: an
    output that opens with it is free until `after_token_ids`, then constrained; any
    other is constrained from its first token."""
    tok = tokenizer_for(llama_dir)
    ids = prompt_ids(llama_dir)[3]
    with LLM(model=llama_dir, num_kv_blocks=64, block_size=8, max_model_len=128) as llm:
        free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        plain = list(llm.generate([{"prompt_token_ids": ids}], free)[0].outputs[0].token_ids)
        start, end = plain[0], plain[3]
        k = plain.index(end)
        choice = StructuredOutputsParams(
            choice=["yes", "no"], after_token_ids=(end,), optional_start_token_id=start
        )
        opens = SamplingParams(temperature=0, max_tokens=40, structured_outputs=choice)
        out = llm.generate([{"prompt_token_ids": ids}], opens)[0].outputs[0]
        assert list(out.token_ids[: k + 1]) == plain[: k + 1]  # opened: free until `end`
        assert tok.decode(out.token_ids[k + 1 :]) in ("yes", "no")
        skips = SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=choice, logit_bias={start: -100}
        )
        out = llm.generate([{"prompt_token_ids": ids}], skips)[0].outputs[0]
        assert tok.decode(out.token_ids) in ("yes", "no") and out.finish_reason == "stop"
        llm.check_block_accounting()
