"""One request's output side: its samples, prompt logprobs and timing."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .handoffs import EngineRequest, RequestUpdate, StopStringHit
from .output_delta import RequestOutputDelta
from .request_metrics import RequestMetrics
from .sample_state import SampleState


class RequestState:
    """Turns a request's updates into deltas: only what no earlier delta had.

    Prompt logprobs computed in steps that gave no token (chunked prefill)
    wait here for the delta of the first token. Every list in a delta and its
    metrics are the delta's own: the next step never appends to them.
    """

    def __init__(self, request: EngineRequest, tokenizer: PreTrainedTokenizerBase) -> None:
        self.request = request
        params = request.params
        self.samples = [
            SampleState(tokenizer, request.prompt_token_ids, params)
            for _ in range(params.num_samples)
        ]
        # Not yet sent: the first prompt token has no logprob (None).
        self._prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def update(
        self, update: RequestUpdate, step_time: float, hits: list[StopStringHit]
    ) -> RequestOutputDelta | None:
        """Apply one step; its delta if a token came or a sample ended (stop-string ends
        go to `hits`)."""
        if self._prompt_logprobs is not None:
            self._prompt_logprobs.extend(update.new_prompt_logprobs)
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
        if has_token or update.embedding is not None:
            if m.first_token_time is None:
                m.first_token_time = step_time
            m.last_token_time = step_time
        finished = self.finished
        if finished:
            m.finished_time = step_time
        return self._output(finished, update.embedding)

    def _output(self, finished: bool, embedding: list[float] | None) -> RequestOutputDelta:
        params, m = self.request.params, self.metrics
        kept = None
        if finished and params.num_samples > params.n:  # best_of: keep the n most likely
            ranked = sorted(
                range(len(self.samples)), key=lambda i: -self.samples[i].cumulative_logprob
            )
            kept = ranked[: params.n]
        prompt_logprobs = self._prompt_logprobs or None  # None: nothing new
        if prompt_logprobs is not None:
            self._prompt_logprobs = []
        return RequestOutputDelta(
            request_id=self.request.request_id,
            outputs=[s.emit(i) for i, s in enumerate(self.samples)],
            finished=finished,
            metrics=m.copy(),
            prompt_logprobs=prompt_logprobs,
            kept=kept,
            embedding=embedding,
        )
