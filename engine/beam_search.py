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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling import SamplingParams
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


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
    seq: Sequence
    score: float  # cumulative logprob of the generated tokens


@dataclass
class _Group:
    prompt: list[int]
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False


def run_beam_search(
    engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search runs on an idle engine")
    bs = engine.capacity.block_size
    width = params.beam_width
    longest = max(len(p) for p in prompts) + params.max_tokens + 1
    if longest > engine.capacity.max_model_len:
        raise ValueError(
            f"prompt + max_tokens exceeds max_model_len ({engine.capacity.max_model_len})"
        )
    per_group = width * -(-longest // bs)
    if width > engine.config.max_num_seqs or per_group > engine.capacity.num_kv_blocks:
        raise ValueError(
            f"beam width {width} needs {per_group} KV blocks and {width} sequences per prompt; "
            f"the engine has {engine.capacity.num_kv_blocks} blocks, max_num_seqs {engine.config.max_num_seqs}"
        )
    at_once = min(engine.capacity.num_kv_blocks // per_group, engine.config.max_num_seqs // width)
    outputs: list[BeamSearchOutput] = []
    for start in range(0, len(prompts), at_once):
        outputs += _search(engine, prompts[start : start + at_once], params)
    return outputs


def _search(
    engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    scheduler, bm = engine.scheduler, engine.block_manager
    width = params.beam_width
    sampling = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=2 * width)
    groups = []
    for i, prompt in enumerate(prompts):
        root = Sequence(request_id=f"beam-{i}", prompt_token_ids=prompt, params=sampling)
        scheduler.add(root)
        groups.append(_Group(prompt, [_Beam(root, 0.0)]))
    eos = set() if params.ignore_eos else set(engine.eos_ids)
    try:
        while not all(g.done for g in groups):
            out = scheduler.schedule()
            if out.preempted:
                raise AssertionError("beam search was sized to avoid preemption")
            result = engine.runner.execute(out, engine.eos_ids)
            scheduler.update(out, result.sampled)
            top = {id(seq): lp for seq, lp in zip(out.seqs, result.logprobs, strict=True) if lp}
            for g in groups:
                if not g.done and all(id(b.seq) in top for b in g.beams):
                    _advance(g, top, params, eos, engine)
    finally:
        for g in groups:
            for b in g.beams:
                scheduler.finish(b.seq, "abort")
    tok = engine.tokenizer
    results = []
    for g in groups:
        best = sorted(g.finished, key=lambda s: -s.score)[:width]
        for s in best:
            s.text = tok.decode(s.output_token_ids, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    bm.check_accounting()
    return results


def _advance(
    g: _Group,
    top: dict[int, dict[int, float]],
    params: BeamSearchParams,
    eos: set[int],
    engine: LLMEngine,
) -> None:
    width = params.beam_width
    scheduler, bm = engine.scheduler, engine.block_manager
    # Candidates in the order Hugging Face ranks them: by score, then beam, then token.
    cands = sorted(
        ((b.score + lp, bi, t) for bi, b in enumerate(g.beams) for t, lp in top[id(b.seq)].items()),
        key=lambda c: (-c[0], c[1], c[2]),
    )[: 2 * width]
    gen_len = g.beams[0].seq.num_output_tokens  # the candidate token is the newest output
    last_step = gen_len >= params.max_tokens
    keep: list[tuple[float, int, int]] = []
    for rank, (score, bi, t) in enumerate(cands):
        if last_step or t in eos:
            if rank < width:
                parent = g.beams[bi].seq
                out_ids = [*parent.output_token_ids[:-1], t]
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
            scheduler.finish(b.seq, "stop")
        g.beams = []
        return

    new_beams: list[_Beam] = []
    reused: set[int] = set()
    for score, bi, t in keep:
        parent = g.beams[bi].seq
        if bi not in reused:
            reused.add(bi)
            child = parent
        else:
            child = scheduler.fork_running(parent, index=len(new_beams))
        bm.replace_last_token(child, t)
        new_beams.append(_Beam(child, score))
    for bi, b in enumerate(g.beams):
        if bi not in reused:
            scheduler.finish(b.seq, "abort")
    g.beams = new_beams
