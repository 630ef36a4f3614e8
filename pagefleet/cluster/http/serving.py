"""What every generating endpoint does before it answers: validate against the engine,
tokenize, and start the request on the engines under its deadline.

Bad input is answered here, with OpenAI's error body, and never reaches an engine:
model name (404), limits (400 naming the limit; `protocol.py` checks what the
request alone shows), prompt length against max_model_len (both numbers in the
message), the bound on a non-streamed response (`response_size.py`). Engine request
ids are the client's `X-Request-Id` while unique on this ingress, else the
endpoint's own (`observability.engine_request_id`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.engine import SamplingParams, StructuredOutputsParams, validate_structured_outputs

from ..config import Limits
from ..replica_messages import EngineInfo, ReplicaRequest
from .backend import EngineBackend
from .errors import APIError
from .fanout import Fanout, RequestStream
from .gate import GateSettings
from .observability import current_record, engine_request_id
from .protocol import ChatCompletionRequest, CompletionRequest
from .response_size import response_bytes
from .structured import constraint_of
from .tokenizer import AsyncTokenizer
from .tools import ToolPlan


@dataclass
class Prepared:
    """A validated request: one prompt's token ids and parameters per engine request."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: list[SamplingParams]  # one per prompt
    stream: bool
    tools: ToolPlan | None = None  # a chat request's (what its answer is parsed for)


class Serving:
    """Validation and start of requests for the endpoints of one ingress replica."""

    def __init__(
        self,
        backend: EngineBackend,
        tokenizer: AsyncTokenizer,
        model_name: str,
        limits: Limits,
        request_timeout_s: float | None = None,
        gate: GateSettings | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._info: EngineInfo | None = None
        self.reconfigure(limits, request_timeout_s, gate or GateSettings())

    def reconfigure(
        self, limits: Limits, request_timeout_s: float | None, gate: GateSettings
    ) -> None:
        """The settings a running ingress changes in place (Serve's `user_config`): each
        request reads them when it is validated, started, or let through the gate, so one
        already started keeps its deadline and limits. `gate.max_body_bytes` is
        `limits.max_body_bytes`."""
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self.gate = GateSettings(gate.api_key, gate.protect_metrics, limits.max_body_bytes)

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self.backend.info()
        return self._info

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    async def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = (await self.info()).vocab_size
        if any(t >= vocab for t in ids):
            raise APIError(400, f"{param} must be integers in [0, {vocab})", param)

    async def check_prompt(self, ids: list[int], max_tokens: int | None) -> int | None:
        """Validate one prompt; returns max_tokens (filled in when not given)."""
        info = await self.info()
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        if any(t >= info.vocab_size for t in ids):
            raise APIError(
                400, f"prompt token ids must be integers in [0, {info.vocab_size})", "prompt"
            )
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens, more than the limit of {limit} "
                "(max_prompt_tokens)",
                "prompt",
            )
        room = info.max_model_len - len(ids)
        if max_tokens is None:  # what the context leaves, within the configured limit
            if self.limits.max_tokens is not None:
                room = min(room, self.limits.max_tokens)
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {info.max_model_len} tokens. "
                    f"However, your prompt has {len(ids)} tokens, which leaves no room for "
                    "the completion. Please reduce the length of the prompt.",
                    "prompt",
                )
            return room
        if len(ids) + max_tokens > info.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {info.max_model_len} tokens. "
                f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the "
                f"prompt, {max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.",
                "max_tokens",
            )
        return max_tokens

    async def check_constraint(
        self, given: tuple[str, StructuredOutputsParams] | None
    ) -> StructuredOutputsParams | None:
        """The constraint, once the grammar library has taken it: one it rejects is a 400
        naming the field that gave it, before anything is queued (checked on the
        tokenizer's thread: a large schema takes a while)."""
        if given is None:
            return None
        param, constraint = given
        error = await self.tokenizer.run(validate_structured_outputs, constraint)
        if error is not None:
            raise APIError(400, f"{param}: {error}", param)
        return constraint

    async def check_response_size(
        self, prep: Prepared, samples: int, logprobs: int | None, echo: bool, chat: bool
    ) -> None:
        """Refuse a non-streamed request whose response could exceed max_response_bytes
        (response_size.py): the ingress builds that response whole in memory."""
        if prep.stream:
            return
        tokens = [
            (p.max_tokens or 0) + (len(ids) if echo else 0)
            for ids, p in zip(prep.prompts, prep.params, strict=True)
        ]
        widths = await self.tokenizer.widths((await self.info()).vocab_size)
        bound = response_bytes(widths, tokens, samples, logprobs, chat)
        limit = self.limits.max_response_bytes
        if bound > limit:
            param = (
                ("top_logprobs" if chat else "logprobs") if logprobs is not None else "max_tokens"
            )
            raise APIError(
                400,
                f"the response could reach {bound} bytes, more than the limit of {limit} "
                "(max_response_bytes): ask for fewer prompts, samples, tokens or logprobs, "
                "or stream it",
                param,
            )

    async def _completion_prompts(
        self, req: CompletionRequest
    ) -> tuple[list[list[int]], list[str | None]]:
        """(token ids, text or None) of each prompt, in whichever form it came."""
        p = req.prompt
        num_prompts = 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)
        if num_prompts > self.limits.max_prompts:
            raise APIError(
                400,
                f"{num_prompts} prompts exceed the limit of {self.limits.max_prompts} per request",
                "prompt",
            )
        if isinstance(p, str):
            return await self.tokenizer.encode_all([p]), [p]
        if p and all(isinstance(x, str) for x in p):
            texts: list[str] = list(p)  # type: ignore[arg-type]
            return await self.tokenizer.encode_all(texts), list(texts)
        if p and all(isinstance(x, int) for x in p):
            return [list(p)], [None]  # type: ignore[arg-type]
        if p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
            return prompts, [None] * len(prompts)
        raise APIError(
            400,
            "prompt must be a non-empty string, list of strings, "
            "list of token ids or list of token-id lists",
            "prompt",
        )

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self.check_model(req.model)
        req.check_limits(self.limits, req.logprobs, req.best_of)
        constraint = await self.check_constraint(constraint_of(req))
        prompts, texts = await self._completion_prompts(req)
        asked = req.requested_max_tokens(self.limits)
        params = []
        for ids in prompts:  # without max_tokens, each prompt gets the room it leaves
            max_tokens = await self.check_prompt(ids, asked)
            params.append(req.to_sampling_params(self.limits, max_tokens, constraint))
        prep = Prepared(prompts, texts, params, req.stream)
        await self.check_response_size(prep, req.n, req.logprobs, req.echo, chat=False)
        return prep

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        req.refuse_functions()
        req.check_chat_limits(self.limits)
        tools = ToolPlan.of(req)
        given = constraint_of(req)
        if tools.constraint is not None and given is not None:
            raise APIError(
                400,
                f"tool_choice {tools.mode!r} sets the output's form itself: "
                f"{given[0]} cannot be given with it",
                given[0],
            )
        if tools.constraint is not None:
            given = ("tool_choice", tools.constraint)
        constraint = await self.check_constraint(given)
        text = await self.tokenizer.chat_prompt(
            req.messages, req.add_generation_prompt, tools.template_tools
        )
        ids = await self.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = await self.check_prompt(ids, req.requested_max_tokens())
        params = req.to_sampling_params(self.limits, max_tokens, constraint)
        prep = Prepared([ids], [text], [params], req.stream, tools)
        await self.check_response_size(prep, req.n, req.top_k_logprobs, echo=False, chat=True)
        return prep

    def start(self, prep: Prepared, request_id: str, arrived: float) -> RequestStream:
        """The request on the engines, under its deadline (`request_timeout_s` from
        `arrived`): one engine request per prompt."""
        many = len(prep.prompts) > 1
        request_id = engine_request_id(request_id)
        record = current_record()
        trace = record.trace_context if record is not None else None
        requests = [
            ReplicaRequest(
                f"{request_id}-{i}" if many else request_id,
                ids,
                params,
                prep.stream,
                trace_context=trace,
            )
            for i, (ids, params) in enumerate(zip(prep.prompts, prep.params, strict=True))
        ]
        timeout = self.request_timeout_s
        deadline = None if timeout is None else arrived + timeout
        return RequestStream(Fanout(self.backend, requests), len(requests), deadline, timeout)
