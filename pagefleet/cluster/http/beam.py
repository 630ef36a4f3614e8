"""`use_beam_search`: beam search at the ingress, over ordinary engine requests (vLLM's
online beam search).

Each step asks the engines, in one fan-out, for the next token of every live beam
(max_tokens 1, the 2 * width most likely tokens' logprobs; the prompt plus the
beam's tokens share their prefix with the step before, so prefix caching keeps a
step's prefill to a token or so). Every (beam, token) pair is a candidate; a
candidate ending in an EOS token (unless `ignore_eos`) is a finished beam, the
`width` best of the others by cumulative logprob are the next live beams. After
`max_tokens` steps, or once none is live, the finished and live beams are ranked
by cum_logprob / generated_length ** length_penalty and the best `width` returned,
best first (the engine's own `LLM.beam_search` ranks the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.engine import SamplingParams

from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest
from .response_models import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
)
from .serving import Prepared, Serving


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated
    cum_logprob: float = 0.0
    finished: bool = False  # ended by an EOS token

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(1, len(self.tokens)) ** length_penalty


@dataclass(frozen=True)
class BeamRequest:
    prompt: list[int]
    width: int
    max_tokens: int
    ignore_eos: bool
    length_penalty: float
    eos: frozenset[int]


async def beam_search(serving: Serving, req: BeamRequest, rid: str, arrived: float) -> list[Beam]:
    """The best `req.width` beams, best first."""
    live, done = [Beam()], []
    for step in range(req.max_tokens):
        tops = await _next_tokens(serving, req, live, f"{rid}-{step}", arrived)
        candidates = []
        for beam, top in zip(live, tops, strict=True):
            for token, logprob in top.items():
                ends = token in req.eos and not req.ignore_eos
                cand = Beam([*beam.tokens, token], beam.cum_logprob + logprob, ends)
                (done if ends else candidates).append(cand)
        live = sorted(candidates, key=lambda b: -b.cum_logprob)[: req.width]
        if not live:
            break
    ranked = sorted(done + live, key=lambda b: -b.score(req.length_penalty))
    return ranked[: req.width]


async def _next_tokens(
    serving: Serving, req: BeamRequest, live: list[Beam], rid: str, arrived: float
) -> list[dict[int, float]]:
    """Each live beam's 2 * width most likely next tokens with their logprobs."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * req.width, ignore_eos=True)
    prompts = [req.prompt + b.tokens for b in live]
    prep = Prepared(prompts, [None] * len(live), [params] * len(live), stream=False)
    tops: dict[int, dict[int, float]] = {}
    stream = serving.start(prep, rid, arrived)
    try:
        await stream.admit()
        async for i, delta in stream:
            for s in delta.samples:
                if s.logprobs:
                    tops[i] = s.logprobs[0]
    finally:
        await stream.aclose()
    if len(tops) != len(live):
        raise APIError(500, "beam search: a step returned no logprobs")
    return [tops[i] for i in range(len(live))]


def beam_request(
    serving: Serving, prep: Prepared, i: int, req: CompletionRequest | ChatCompletionRequest
) -> BeamRequest:
    """Prompt i's search, as its prepared parameters say (max_tokens resolved)."""
    eos = serving.tokenizer.tokenizer.eos_token_id
    return BeamRequest(
        prompt=prep.prompts[i],
        width=req.n,
        max_tokens=prep.params[i].max_tokens or 1,
        ignore_eos=req.ignore_eos,
        length_penalty=req.length_penalty,
        eos=frozenset() if eos is None else frozenset([eos]),
    )


async def _searched(
    serving: Serving,
    prep: Prepared,
    req: CompletionRequest | ChatCompletionRequest,
    rid: str,
    arrived: float,
) -> list[tuple[int, Beam, str]]:
    """(prompt, beam, its text) for every prompt's beams, in order."""
    out = []
    for i in range(len(prep.prompts)):
        search = beam_request(serving, prep, i, req)
        for beam in await beam_search(serving, search, f"{rid}-{i}", arrived):
            ids = beam.tokens[:-1] if beam.finished else beam.tokens
            out.append((i, beam, await serving.tokenizer.decode(ids)))
    return out


def _usage(prep: Prepared, found: list[tuple[int, Beam, str]]) -> UsageInfo:
    return UsageInfo.of(sum(len(p) for p in prep.prompts), sum(len(b.tokens) for _, b, _ in found))


async def beam_completion(
    serving: Serving, req: CompletionRequest, prep: Prepared, rid: str, arrived: float
) -> CompletionResponse:
    found = await _searched(serving, prep, req, rid, arrived)
    choices = []
    for k, (i, beam, text) in enumerate(found):
        if req.echo:
            text = (prep.prompt_texts[i] or await serving.tokenizer.decode(prep.prompts[i])) + text
        reason = "stop" if beam.finished else "length"
        choices.append(CompletionChoice(index=k, text=text, finish_reason=reason))
    return CompletionResponse(
        id=rid, model=serving.model_name, choices=choices, usage=_usage(prep, found)
    )


async def beam_chat(
    serving: Serving, req: ChatCompletionRequest, prep: Prepared, rid: str, arrived: float
) -> ChatCompletionResponse:
    found = await _searched(serving, prep, req, rid, arrived)
    choices = [
        ChatCompletionChoice(
            index=k,
            message=ChatResponseMessage(content=text),
            finish_reason="stop" if beam.finished else "length",
        )
        for k, (_, beam, text) in enumerate(found)
    ]
    return ChatCompletionResponse(
        id=rid, model=serving.model_name, choices=choices, usage=_usage(prep, found)
    )
