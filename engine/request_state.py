"""One request's output side: its samples, prompt logprobs and timing."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .handoffs import EngineRequest, RequestUpdate, StopStringHit
from .outputs import RequestOutput
from .request_metrics import RequestMetrics
from .sample_state import SampleState


class RequestState:
    """Turns a request's updates into RequestOutputs that never change once handed out.

    Every list in an output (token ids, logprobs, prompt token ids, prompt
    logprobs) and its metrics are copies: the next step appends to this
    state's lists, never to a caller's.
    """

    def __init__(self, request: EngineRequest, tokenizer: PreTrainedTokenizerBase) -> None:
        self.request = request
        params = request.params
        self.samples = [
            SampleState(tokenizer, request.prompt_token_ids, params)
            for _ in range(params.num_samples)
        ]
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def update(
        self, update: RequestUpdate, step_time: float, hits: list[StopStringHit]
    ) -> RequestOutput | None:
        """Apply one step; the output for it if a token came (stop-string ends go to `hits`)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(update.new_prompt_logprobs)
        has_token = update.has_new_token
        if not has_token and not any(
            u.finish_reason and not self.samples[u.index].finished for u in update.samples
        ):
            return None
        for u in update.samples:
            stop = self.samples[u.index].update(u)
            if stop is not None:
                hits.append(StopStringHit(self.request.request_id, u.index, stop))
        m = self.metrics
        if has_token:
            if m.first_token_time is None:
                m.first_token_time = step_time
            m.last_token_time = step_time
        finished = self.finished
        if finished:
            m.finished_time = step_time
        return self._output(finished)

    def _output(self, finished: bool) -> RequestOutput:
        params, m = self.request.params, self.metrics
        positions = list(range(len(self.samples)))
        if finished and params.num_samples > params.n:  # best_of: keep the n most likely
            positions = sorted(positions, key=lambda i: -self.samples[i].cumulative_logprob)
            positions = positions[: params.n]
        return RequestOutput(
            request_id=self.request.request_id,
            prompt=self.request.prompt,
            prompt_token_ids=list(self.request.prompt_token_ids),
            outputs=[
                self.samples[i].emit(pos if finished else i) for pos, i in enumerate(positions)
            ],
            finished=finished,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            # Spelled out rather than dataclasses.replace: this runs per request per step.
            metrics=RequestMetrics(
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                m.last_token_time,
                m.finished_time,
            ),
        )
