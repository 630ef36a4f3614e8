"""Every malformed request is refused by add_request with ValueError, and nothing is queued.

A server maps ValueError to a 400 and carries on; any other exception type
means an engine bug, so these check the exact type and the message.
"""

from __future__ import annotations

import pytest

from pagefleet.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir: str) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=16, block_size=8, max_num_seqs=4))
    yield eng
    eng.check_block_accounting()


GOOD = SamplingParams(temperature=0, max_tokens=2)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": 5}, "list of integers, got int"),
        ({"prompt_token_ids": None}, "list of integers, got NoneType"),
        ({"prompt_token_ids": "abc"}, "list of integers, got str"),
        ({"prompt_token_ids": {1: 2}}, "list of integers, got dict"),
        ({"prompt_token_ids": [1, 2.0]}, "integers in"),
        ({"prompt_token_ids": [1, True]}, "integers in"),
        ({"prompt_token_ids": [[1, 2]]}, "integers in"),
        ({"prompt_token_ids": [1, None]}, "integers in"),
        ({"prompt": 5}, "'prompt' must be a str, got int"),
        ({"prompt": None}, "needs 'prompt' or 'prompt_token_ids'"),
        ({}, "needs 'prompt' or 'prompt_token_ids'"),
        ({"text": "hi"}, "unsupported prompt keys"),
        ({"prompt_token_ids": [1], "extra": 1}, "unsupported prompt keys"),
        (None, "a prompt is a str, .* got NoneType"),
        (b"bytes", "a prompt is a str, .* got bytes"),
        (7, "a prompt is a str, .* got int"),
        ([1, "a"], "integers in"),
    ],
)
def test_malformed_prompt_raises_value_error(
    engine: LLMEngine, prompt: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, GOOD)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    engine.check_block_accounting()


@pytest.mark.parametrize(
    "params, message",
    [
        (None, "params must be a SamplingParams, got NoneType"),
        ({"max_tokens": 4}, "params must be a SamplingParams, got dict"),
        (SamplingParams(max_tokens=2.5), "max_tokens must be an integer"),
        (SamplingParams(logprobs=2.5), "logprobs must be an integer"),
        (SamplingParams(prompt_logprobs=True), "prompt_logprobs must be an integer"),
        (SamplingParams(top_k=1.5), "top_k must be an integer"),
        (SamplingParams(temperature=True), "temperature must be a number"),
        (SamplingParams(ignore_eos="yes"), "ignore_eos must be a bool"),
        (SamplingParams(stop_token_ids=[True]), "stop_token_ids must be integers"),
        (SamplingParams(stop_token_ids=[5000]), "stop_token_ids must be < vocab size 1024"),
        (SamplingParams(n=5), r"n / best_of \(5\) exceeds max_num_seqs \(4\)"),
    ],
)
def test_malformed_params_raise_value_error(
    engine: LLMEngine, params: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", "import os", params)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("request_id", [None, 3, ["a"], ""])
def test_malformed_request_id_raises_value_error(engine: LLMEngine, request_id: object) -> None:
    with pytest.raises(ValueError, match="a request id is a non-empty str"):
        engine.add_request(request_id, "import os", GOOD)
    assert engine.get_num_unfinished_requests() == 0


def test_engine_serves_after_refusals(engine: LLMEngine) -> None:
    with pytest.raises(ValueError):
        engine.add_request("r", {"prompt_token_ids": 5}, GOOD)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GOOD)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.finished for o in outs] == [False, True]
    assert len(outs[-1].outputs[0].token_ids) == 2
    engine.check_block_accounting()
