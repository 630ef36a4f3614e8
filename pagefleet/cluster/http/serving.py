"""What every generating endpoint does before it answers: validate against the engine,
tokenize, and start the request on the engines, all under its deadline
(`request_timeout_s` from its arrival: `in_time` bounds validation and tokenization,
the request stream what follows).

Bad input is answered here, with OpenAI's error body, and never reaches an engine:
model name (404), limits (400 naming the limit; `protocol.py` checks what the
request alone shows), prompt length against max_model_len (both numbers in the
message), the bound on a non-streamed response (`response_size.py`), an output
constraint past its sizes or refused by llguidance against the vocabulary (checked
on the `ConstraintValidator`'s own threads, never the tokenizer's). Engine request
ids are the client's `X-Request-Id` while unique on this ingress, else the
endpoint's own (`observability.engine_request_id`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from pagefleet.engine import (
    MAX_LOGPROBS,
    ConstraintValidator,
    SamplingParams,
    StructuredOutputsParams,
)

from ..config import ChatSettings, Limits
from ..replica_messages import EngineInfo, ReplicaRequest
from .backend import EngineBackend
from .errors import APIError
from .fanout import Fanout, RequestStream, timed_out
from .fields import CHAT_FIELDS, COMPLETION_FIELDS, refuse_unsupported
from .gate import GateSettings
from .model_tool_parsers import NEEDS_SPECIAL_TOKENS, choose
from .observability import current_record, engine_request_id
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .reasoning_parsers import OPENED_IN_TEXT, THINK_CLOSE, THINK_OPEN
from .response_size import response_bytes
from .schemas import closed_objects
from .structured import check_size, constraint_of
from .tokenizer import AsyncTokenizer, TemplateInputs
from .tools import ToolPlan

logger = logging.getLogger("pagefleet.http")
_T = TypeVar("_T")


PRIORITY_DISABLED = (
    "priority is not supported by this server: the engine schedules first come, first "
    "served; set engine.scheduling_policy: priority to enable it"
)


@dataclass
class Prepared:
    """A validated request: one prompt's token ids and parameters per engine request."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: list[SamplingParams]  # one per prompt
    stream: bool
    tools: ToolPlan | None = None  # a chat request's (what its answer is parsed for)
    reasoning_parser: str | None = None  # a chat request's, when its reasoning is read
    cache_salt: str | None = None


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
        sampling_defaults: Mapping[str, float] | None = None,
        chat: ChatSettings | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        self.backend = backend
        self.priority_scheduling = priority_scheduling
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.defaults = dict(sampling_defaults or {})
        self._info: EngineInfo | None = None
        self.constraints = ConstraintValidator()
        self.reconfigure(limits, request_timeout_s, gate or GateSettings())
        self.chat = chat or ChatSettings()
        self.tool_call_parser, self.reasoning_parser = self._parsers()

    def _parsers(self) -> tuple[str, str | None]:
        """The tool-call parser (the setting's, else the chat template's: one log line
        names it) and the reasoning parser (gpt-oss's channels go with its tool calls)."""
        tool = self.chat.tool_call_parser
        if tool is None:
            tool = choose(getattr(self.tokenizer.tokenizer, "chat_template", None))
            logger.info("tool_call_parser: %s (chosen from the chat template)", tool)
        reasoning = self.chat.reasoning_parser
        if reasoning is None and tool == "openai":
            reasoning = "openai_gptoss"
        return tool, reasoning

    def reconfigure(
        self, limits: Limits, request_timeout_s: float | None, gate: GateSettings
    ) -> None:
        """The settings a running ingress changes in place (Serve's `user_config`): each
        request reads them when it is validated, started, or let through the gate, so one
        already started keeps its deadline and limits. `gate.max_body_bytes` is
        `limits.max_body_bytes`."""
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self.gate = GateSettings(
            gate.api_key, gate.protect_metrics, limits.max_body_bytes, limits.body_read_timeout_s
        )

    async def in_time(self, arrived: float, work: Awaitable[_T]) -> _T:
        """`work` (a request's validation and tokenization) under the request's deadline
        (`request_timeout_s` from `arrived`, the loop's time): past it, a 408."""
        timeout = self.request_timeout_s
        if timeout is None:
            return await work
        try:
            async with asyncio.timeout_at(arrived + timeout):
                return await work
        except TimeoutError:
            raise timed_out(timeout) from None

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self.backend.info()
        return self._info

    def capped(self, max_tokens: int | None) -> int | None:
        """max_tokens within the checkpoint's max_new_tokens, where it has one (vLLM)."""
        cap = self.defaults.get("max_tokens")
        return max_tokens if cap is None or max_tokens is None else min(max_tokens, int(cap))

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
        """The constraint, once the grammar library has taken it: one past the configured
        sizes, one it rejects, or one whose check outlasts `constraint_check_timeout_s` is
        a 400 naming the field that gave it, before anything is queued (checked on the
        validator's own threads, against the model's vocabulary: `ConstraintValidator`).
        A JSON schema's objects are closed first (`schemas.py`) unless the server reads
        schemas leniently."""
        if given is None:
            return None
        param, constraint = given
        check_size(param, constraint, self.limits)
        if constraint.json is not None and self.chat.disable_additional_properties:
            constraint = StructuredOutputsParams(json=closed_objects(constraint.json))
        await self._give_vocabulary()
        future = asyncio.wrap_future(self.constraints.submit(constraint))
        timeout = self.limits.constraint_check_timeout_s
        done, _ = await asyncio.wait([future], timeout=timeout)
        if not done or future.cancelled():
            self.constraints.forget(constraint)
            raise APIError(
                400,
                f"{param}: the constraint could not be checked within {timeout:g} s "
                "(constraint_check_timeout_s)",
                param,
            )
        error = future.result()
        if error is not None:
            raise APIError(400, f"{param}: {error}", param)
        return constraint

    async def _give_vocabulary(self) -> None:
        """Constraints are checked against the model's vocabulary once it is known."""
        if not self.constraints.has_vocabulary:
            info = await self.info()
            text = await self.tokenizer.run(self.tokenizer.to_json)
            if text is not None and not self.constraints.has_vocabulary:
                self.constraints.set_vocabulary(text, info.vocab_size, self.tokenizer.eos_ids)

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

    async def check_sampling_fields(self, req: SamplingFields) -> None:
        """What the shared sampling fields ask that this server or this model cannot do."""
        if req.use_beam_search:
            self.check_beam_search(req)
        if req.priority and not self.priority_scheduling:
            raise APIError(400, PRIORITY_DISABLED, "priority")
        if req.length_penalty != 1.0 and not req.use_beam_search:
            raise APIError(400, "length_penalty needs use_beam_search: true", "length_penalty")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(
                400, "prompt_logprobs are not available when streaming", "prompt_logprobs"
            )
        if req.allowed_token_ids is not None:
            await self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")
        bias = req.logit_bias_ids()
        if bias:
            await self.check_token_ids(list(bias), "logit_bias")

    @staticmethod
    def check_beam_search(req: SamplingFields) -> None:
        """What beam search cannot be combined with: a 400 naming the field."""
        if req.stream:
            raise APIError(400, "use_beam_search cannot be streamed", "use_beam_search")
        if 2 * req.n > MAX_LOGPROBS:
            raise APIError(400, f"beam search takes n <= {MAX_LOGPROBS // 2} beams", "n")
        if constraint_of(req) is not None:
            raise APIError(
                400, "use_beam_search cannot follow an output constraint", "use_beam_search"
            )
        if getattr(req, "best_of", None) not in (None, req.n):
            raise APIError(400, "use_beam_search returns n beams: best_of is not used", "best_of")

    def truncated(self, ids: list[int], req: SamplingFields) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's), or all of it."""
        k = req.truncate_prompt_tokens
        return ids if k is None or k >= len(ids) else ids[-k:]

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
        special = req.add_special_tokens
        if isinstance(p, str):
            return await self.tokenizer.encode_all([p], special), [p]
        if p and all(isinstance(x, str) for x in p):
            texts: list[str] = list(p)  # type: ignore[arg-type]
            return await self.tokenizer.encode_all(texts, special), list(texts)
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
        refuse_unsupported(req.model_extra, COMPLETION_FIELDS)
        req.check_limits(self.limits, req.logprobs, req.best_of)
        await self.check_sampling_fields(req)
        constraint = await self.check_constraint(constraint_of(req))
        prompts, texts = await self._completion_prompts(req)
        if req.truncate_prompt_tokens is not None:
            prompts = [self.truncated(ids, req) for ids in prompts]
            texts = [None] * len(prompts)
        asked = req.requested_max_tokens(self.limits)
        params = []
        for ids in prompts:  # without max_tokens, each prompt gets the room it leaves
            max_tokens = self.capped(await self.check_prompt(ids, asked))
            params.append(
                req.to_sampling_params(self.limits, max_tokens, constraint, self.defaults)
            )
        prep = Prepared(prompts, texts, params, req.stream, cache_salt=req.cache_salt)
        await self.check_response_size(prep, req.n, req.logprobs, req.echo, chat=False)
        return prep

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        req.refuse_functions()
        refuse_unsupported(req.model_extra, CHAT_FIELDS)
        req.check_chat_limits(self.limits)
        await self.check_sampling_fields(req)
        tools = ToolPlan.of(req, self.tool_call_parser)
        if req.use_beam_search and tools.mode != "none":
            raise APIError(400, "use_beam_search does not read tool calls", "use_beam_search")
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
        text = await self.tokenizer.chat_prompt(req.messages, self.template_inputs(req, tools))
        ids = await self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        ids = self.truncated(ids, req)
        max_tokens = self.capped(await self.check_prompt(ids, req.requested_max_tokens()))
        constraint, reasoning = await self.after_reasoning(constraint, text)
        params = req.to_sampling_params(self.limits, max_tokens, constraint, self.defaults)
        if self.keeps_special_tokens(tools, reasoning):
            params = replace(params, skip_special_tokens=False)
        prep = Prepared([ids], [text], [params], req.stream, tools, reasoning, req.cache_salt)
        await self.check_response_size(prep, req.n, req.top_k_logprobs, echo=False, chat=True)
        return prep

    async def after_reasoning(
        self, constraint: StructuredOutputsParams | None, prompt: str
    ) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint and the reasoning parser of a chat answer. With `<think>`
        reasoning still open after the prompt, the grammar applies only after the
        model's `</think>` (the reasoning is free text); `qwen3`'s model opens its
        reasoning itself and may skip it, so there the grammar waits for `</think>`
        only if the answer opens with `<think>` (one token), and shapes it from its
        first token otherwise. With the reasoning closed in the prompt (Qwen3's
        `enable_thinking: false`), a grammar shapes the text from its first token, and
        only a parser that reads reasoning where the text opens it is kept."""
        reasoning = self.reasoning_parser
        if constraint is None:
            return None, reasoning
        thinks = reasoning in ("deepseek_r1", "qwen3")
        if thinks and not prompt.rstrip().endswith(THINK_CLOSE):
            markers = [THINK_CLOSE, THINK_OPEN] if reasoning == "qwen3" else [THINK_CLOSE]
            close, *opener = await self.tokenizer.encode_all(markers, add_special_tokens=False)
            start = opener[0][0] if opener and len(opener[0]) == 1 else None
            return replace(
                constraint, after_token_ids=tuple(close), optional_start_token_id=start
            ), reasoning
        return constraint, reasoning if reasoning in OPENED_IN_TEXT else None

    def keeps_special_tokens(self, tools: ToolPlan, reasoning: str | None) -> bool:
        """Whether the parsers read markers that are special tokens (gpt-oss's channels,
        Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`)."""
        parsed = tools.mode == "auto" and self.tool_call_parser in NEEDS_SPECIAL_TOKENS
        return parsed or reasoning == "openai_gptoss"

    def template_inputs(self, req: ChatCompletionRequest, tools: ToolPlan) -> TemplateInputs:
        """What the chat template renders besides the messages; `chat_template_kwargs` keys
        outside the server's allow-list, and `continue_final_message` with
        `add_generation_prompt` (as vLLM: the two contradict), are 400s."""
        extra = dict(req.chat_template_kwargs or {})
        allowed = self.chat.chat_template_kwargs_allowed
        for key in extra:
            if key not in allowed or key in TemplateInputs.RESERVED:
                raise APIError(
                    400,
                    f"chat_template_kwargs may set only {', '.join(allowed) or 'nothing'} "
                    f"on this server, not {key!r}",
                    "chat_template_kwargs",
                )
        if req.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", req.reasoning_effort)
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                "(send add_generation_prompt: false)",
                "continue_final_message",
            )
        return TemplateInputs(
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=tools.template_tools,
            documents=req.documents,
            kwargs=extra,
        )

    def start(self, prep: Prepared, request_id: str, arrived: float) -> RequestStream:
        """The request on the engines, under its deadline (`request_timeout_s` from
        `arrived`): one engine request per prompt."""
        many = len(prep.prompts) > 1
        request_id = engine_request_id(request_id)
        record = current_record()
        requests = [
            ReplicaRequest(
                rid,
                ids,
                params,
                prep.stream,
                cache_salt=prep.cache_salt,
                trace_context=None if record is None else record.route_context(rid),
            )
            for i, (ids, params) in enumerate(zip(prep.prompts, prep.params, strict=True))
            for rid in [f"{request_id}-{i}" if many else request_id]
        ]
        timeout = self.request_timeout_s
        deadline = None if timeout is None else arrived + timeout
        return RequestStream(Fanout(self.backend, requests), len(requests), deadline, timeout)
