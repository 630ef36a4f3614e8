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
