"""Outputs out: each token-engine step's token ids become per-request deltas for the callers."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .handoffs import EngineRequest, ProcessedOutputs, StopStringHit, TokenStepOutput
from .output_delta import RequestOutputDelta
from .request_state import RequestState


class OutputProcessor:
    """The output side of every request the engine holds, by request id.

    A request's state lives from `add` until the output that says it is
    finished (or `abort`); stop strings are found here, and the samples they
    end are handed back to the engine to free in the token engine.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def add(self, request: EngineRequest) -> None:
        self._requests[request.request_id] = RequestState(request, self.tokenizer)

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, step_output: TokenStepOutput) -> ProcessedOutputs:
        for rid in step_output.first_scheduled:
            state = self._requests.get(rid)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = step_output.scheduled_time
        outputs: list[RequestOutputDelta] = []
        hits: list[StopStringHit] = []
        for update in step_output.updates:
            state = self._requests.get(update.request_id)
            if state is None:  # aborted meanwhile
                continue
            out = state.update(update, step_output.step_time, hits)
            if out is None:
                continue
            outputs.append(out)
            if out.finished:
                del self._requests[update.request_id]
        return ProcessedOutputs(outputs, hits)
