"""Beam search over the paged engine, with forked block tables and copy-on-write.

Every step each live beam yields the log-probabilities of its 2 * width most
likely next tokens (the union holds the group's overall top 2 * width).
Candidates are ranked by cumulative logprob, as Hugging Face's beam search
does:

- a candidate ending in EOS among the top `width` ranks becomes a finished
  hypothesis, scored sum_logprob / generated_length ** length_penalty;
- the best `width` candidates that do not end in EOS become the next beams;
- at the last step (max_tokens) the top `width` candidates all finish;
- with early stopping, the search ends once `width` hypotheses are finished.

The next beams are made from their parents without copying any K/V: the
first child of a parent is the parent itself with its newest (not yet
computed) token replaced; every further child is a fork sharing all of the
parent's blocks. When two siblings then write their next token into the same
partly filled block, the block manager copies it for one of them. Parents
with no child are freed.

To keep all beams of a group in lock step, the search admits only as many
groups as the KV pool holds without sharing, so preemption cannot occur.

The search drives the token engine through its public step API: each prompt
is one request, each beam one of its samples (told apart by index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from .handoffs import EngineRequest
from .sampling_params import SamplingParams
from .token_engine import TokenEngine


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool = True

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as vLLM reports
    output_token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(output) ** length_penalty
    text: str = ""  # the generated part, decoded
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Beam:
    index: int  # the engine sample that carries it
    tokens: list[int]  # generated tokens before the newest (the candidate the engine sampled)
    score: float  # cumulative logprob of the generated tokens


@dataclass
class _Group:
    request_id: str
    prompt: list[int]
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False
    next_index: int = 1  # sample index for the next forked beam


def run_beam_search(
    engine: TokenEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    params: BeamSearchParams,
) -> list[BeamSearchOutput]:
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search runs on an idle engine")
    cap = engine.capacity
    max_num_seqs = engine.scheduler.max_num_seqs
    width = params.beam_width
    longest = max(len(p) for p in prompts) + params.max_tokens + 1
    if longest > cap.max_model_len:
        raise ValueError(f"prompt + max_tokens exceeds max_model_len ({cap.max_model_len})")
    per_group = width * -(-longest // cap.block_size)
    if width > max_num_seqs or per_group > cap.num_kv_blocks:
        raise ValueError(
            f"beam width {width} needs {per_group} KV blocks and {width} sequences per prompt; "
            f"the engine has {cap.num_kv_blocks} blocks, max_num_seqs {max_num_seqs}"
        )
    at_once = min(cap.num_kv_blocks // per_group, max_num_seqs // width)
    outputs: list[BeamSearchOutput] = []
    for start in range(0, len(prompts), at_once):
        outputs += _search(engine, tokenizer, prompts[start : start + at_once], params)
    return outputs


def _search(
    engine: TokenEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    params: BeamSearchParams,
) -> list[BeamSearchOutput]:
    width = params.beam_width
    sampling = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=2 * width)
    groups = []
    for i, prompt in enumerate(prompts):
        rid = f"beam-{i}"
        engine.add(EngineRequest(rid, None, prompt, sampling, 0.0))
        groups.append(_Group(rid, prompt, [_Beam(0, [], 0.0)]))
    eos = set() if params.ignore_eos else set(engine.eos_ids)
    try:
        while not all(g.done for g in groups):
            step = engine.step()
            if step is None:
                raise AssertionError("beam search left a group with nothing to schedule")
            if step.num_preempted:
                raise AssertionError("beam search was sized to avoid preemption")
            top = {
                (u.request_id, s.index): s.logprobs
                for u in step.updates
                for s in u.samples
                if s.token is not None and s.logprobs
            }
            for g in groups:
                if not g.done and all((g.request_id, b.index) in top for b in g.beams):
                    _advance(g, top, params, eos, engine)
    finally:
        for g in groups:
            for b in g.beams:
                engine.finish_sequence(g.request_id, b.index, "abort")
    results = []
    for g in groups:
        best = sorted(g.finished, key=lambda s: -s.score)[:width]
        for s in best:
            s.text = tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    engine.check_block_accounting()
    return results


def _advance(
    g: _Group,
    top: dict[tuple[str, int], dict[int, float]],
    params: BeamSearchParams,
    eos: set[int],
    engine: TokenEngine,
) -> None:
    width = params.beam_width
    # Candidates in the order Hugging Face ranks them: by score, then beam, then token.
    cands = sorted(
        (
            (b.score + lp, bi, t)
            for bi, b in enumerate(g.beams)
            for t, lp in top[(g.request_id, b.index)].items()
        ),
        key=lambda c: (-c[0], c[1], c[2]),
    )[: 2 * width]
    gen_len = len(g.beams[0].tokens) + 1  # the candidate token is the newest output
    last_step = gen_len >= params.max_tokens
    keep: list[tuple[float, int, int]] = []
    for rank, (score, bi, t) in enumerate(cands):
        if last_step or t in eos:
            if rank < width:
                out_ids = [*g.beams[bi].tokens, t]
                g.finished.append(
                    BeamSearchSequence(
                        tokens=[*g.prompt, *out_ids],
                        output_token_ids=out_ids,
                        cum_logprob=score,
                        score=score / (gen_len**params.length_penalty),
                        finish_reason="stop" if t in eos else "length",
                    )
                )
        elif len(keep) < width:
            keep.append((score, bi, t))
    g.finished = sorted(g.finished, key=lambda s: -s.score)[:width]
    if last_step or (params.early_stopping and len(g.finished) >= width) or not keep:
        g.done = True
        for b in g.beams:
            engine.finish_sequence(g.request_id, b.index, "stop")
        g.beams = []
        return

    new_beams: list[_Beam] = []
    reused: set[int] = set()
    for score, bi, t in keep:
        parent = g.beams[bi]
        if bi not in reused:
            reused.add(bi)
            index = parent.index
        else:
            index, g.next_index = g.next_index, g.next_index + 1
            engine.fork(g.request_id, parent.index, index)
        engine.replace_last_token(g.request_id, index, t)
        new_beams.append(_Beam(index, [*parent.tokens, t], score))
    for bi, b in enumerate(g.beams):
        if bi not in reused:
            engine.finish_sequence(g.request_id, b.index, "abort")
    g.beams = new_beams
