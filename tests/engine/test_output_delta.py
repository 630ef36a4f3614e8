"""The engine core's per-step message: only each request's news, typed msgpack.

A step's message must not grow with a prompt's length or with what a request has
generated already (before, every step re-sent each request's whole state: O(context)
per request per step). The deltas are rebuilt into vLLM's cumulative outputs on the
caller's side, and merged exactly when a consumer takes several at once.
"""

from __future__ import annotations

import pytest

from pagefleet.engine import SamplingParams
from pagefleet.engine.core_messages import CoreEvents, decode_events, encode_events
from pagefleet.engine.handoffs import EngineRequest, RequestUpdate, SampleUpdate
from pagefleet.engine.output_accumulator import OutputAccumulator
from pagefleet.engine.output_delta import CompletionOutputDelta, RequestOutputDelta, merge
from pagefleet.engine.request_metrics import RequestMetrics
from pagefleet.engine.request_state import RequestState
from tests.conftest import tokenizer_for


def token(tok) -> int:
    return tok.encode("cat", add_special_tokens=False)[-1]


def state(tok, rid: str, prompt_len: int, generated: int, params: SamplingParams) -> RequestState:
    """A request with a prompt of `prompt_len` tokens that has generated `generated` already."""
    t = token(tok)
    s = RequestState(EngineRequest(rid, None, [t] * prompt_len, params, 1.0), tok)
    for _ in range(generated):
        step(s, t, params, 2.0)
    return s


def step(s: RequestState, t: int, params: SamplingParams, when: float) -> RequestOutputDelta:
    logprobs = {t: -0.5, t + 1: -1.5} if params.logprobs else None
    prompt = [{t: -0.25}] * (len(s.request.prompt_token_ids) - 1) if params.prompt_logprobs else []
    if s._prompt_logprobs is not None and len(s._prompt_logprobs) == 0:
        prompt = []  # already sent with the first token
    out = s.update(
        RequestUpdate(
            s.request.request_id, [SampleUpdate(0, t, logprobs, -0.5, None, None)], prompt
        ),
        when,
        [],
    )
    assert out is not None
    return out


@pytest.mark.parametrize(
    ("params", "size"),
    [
        (SamplingParams(max_tokens=1000), 59),
        (SamplingParams(max_tokens=1000, logprobs=1), 92),
        (SamplingParams(max_tokens=1000, logprobs=1, prompt_logprobs=0), 92),
    ],
    ids=["plain", "logprobs", "prompt-logprobs-after-the-first"],
)
def test_a_steps_message_does_not_grow_with_the_prompt_or_the_output_so_far(
    llama_dir: str, params: SamplingParams, size: int
) -> None:
    tok = tokenizer_for(llama_dir)
    t = token(tok)
    fresh = state(tok, "a", prompt_len=8, generated=1, params=params)
    old = state(tok, "b", prompt_len=4000, generated=500, params=params)
    sizes = [
        len(encode_events(CoreEvents(outputs=[step(s, t, params, 3.0)]))) for s in (fresh, old)
    ]
    assert sizes == [size, size]


def test_the_first_delta_carries_the_prompt_logprobs_held_since_prefill(llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    params = SamplingParams(max_tokens=10, prompt_logprobs=0)
    t = token(tok)
    s = RequestState(EngineRequest("a", None, [t] * 4, params, 1.0), tok)
    # A chunked prefill: two prompt logprobs in a step without a token (no delta)...
    assert (
        s.update(
            RequestUpdate("a", [SampleUpdate(0, None, None, None, None, None)], [{t: -1.0}] * 2),
            1.5,
            [],
        )
        is None
    )
    # ...then the last one with the first token: all of them, once.
    first = s.update(
        RequestUpdate("a", [SampleUpdate(0, t, None, None, None, None)], [{t: -2.0}]), 2.0, []
    )
    assert first is not None
    assert first.prompt_logprobs == [None, {t: -1.0}, {t: -1.0}, {t: -2.0}]
    second = s.update(RequestUpdate("a", [SampleUpdate(0, t, None, None, None, None)], []), 2.5, [])
    assert second is not None and second.prompt_logprobs is None


def delta(rid: str, ids: list[int], text: str, finished: bool = False, **kw) -> RequestOutputDelta:
    return RequestOutputDelta(
        rid,
        [CompletionOutputDelta(0, ids, text, **kw)],
        finished,
        RequestMetrics(1.0, 1.5, 2.0, 2.0 + len(ids), 9.0 if finished else None),
    )


def test_events_round_trip_exactly() -> None:
    events = CoreEvents(
        accepted=["a"],
        prompt_token_ids={"a": [1, 2, 3]},
        outputs=[
            delta("a", [5, 6], "hi", logprobs=[{5: -0.5}, {6: -1.0}], cumulative_logprob=-1.5)
        ],
    )
    assert decode_events(encode_events(events)) == events


def test_merged_deltas_are_the_deltas_in_order() -> None:
    a = delta("r", [1], "a", logprobs=[{1: -0.1}])
    b = delta("r", [2, 3], "bc", logprobs=[{2: -0.2}, {3: -0.3}])
    c = delta("r", [], "", finished=True, logprobs=[], finish_reason="stop", stop_reason=7)
    m = merge(merge(a, b), c)
    assert m.outputs == [
        CompletionOutputDelta(
            0, [1, 2, 3], "abc", [{1: -0.1}, {2: -0.2}, {3: -0.3}], None, "stop", 7
        )
    ]
    assert m.finished and m.metrics == c.metrics
    # Whole outputs from the merged delta equal those from the three.
    one, three = OutputAccumulator(), OutputAccumulator()
    one.add("r", None, [9])
    three.add("r", None, [9])
    whole = one.apply(m)
    for d in (a, b, c):
        last = three.apply(d)
    # Alike but for what the last delta added (new_token_ids, new_text).
    fields = ("token_ids", "text", "logprobs", "finish_reason", "stop_reason")
    assert [[getattr(o, f) for f in fields] for o in whole.outputs] == [
        [getattr(o, f) for f in fields] for o in last.outputs
    ]
    assert (whole.finished, whole.metrics, whole.prompt_token_ids) == (
        last.finished,
        last.metrics,
        last.prompt_token_ids,
    )
    assert whole.outputs[0].new_token_ids == [1, 2, 3] and last.outputs[0].new_token_ids == []
    assert whole.outputs[0].token_ids == [1, 2, 3] and whole.outputs[0].text == "abc"
    assert len(one) == len(three) == 0  # forgotten once finished


def test_best_of_keeps_the_samples_named_in_their_order() -> None:
    acc = OutputAccumulator()
    acc.add("r", "p", [9])
    metrics = RequestMetrics(1.0)
    acc.apply(
        RequestOutputDelta(
            "r", [CompletionOutputDelta(i, [i], str(i)) for i in range(3)], False, metrics
        )
    )
    out = acc.apply(
        RequestOutputDelta(
            "r",
            [CompletionOutputDelta(i, [], "", finish_reason="length") for i in range(3)],
            True,
            metrics,
            kept=[2, 0],
        )
    )
    assert [(c.index, c.token_ids, c.text) for c in out.outputs] == [(0, [2], "2"), (1, [0], "0")]
