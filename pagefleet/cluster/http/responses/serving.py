"""`/v1/responses` over the chat path: a Responses request is a chat completion.

The conversation (`protocol.py`) is rendered by the model's chat template and started
as a chat request (`Serving.prepare_chat`: its limits, its tool grammars for
`tool_choice: required` or a named function, `text.format` as `response_format`).
The chat stream's choices (`ChatBuilder`, streamed form) become Responses output
items as they come (`OutputAssembler`): plain text is a `message` item whose text
grows by `response.output_text.delta`, each tool call a `function_call` item whose
arguments grow by `response.function_call_arguments.delta`. Every item is closed
(its `.done` events) when the next one opens or the sample ends. A streamed answer is
those events; a plain one is the final response they built. A stored response keeps
its conversation (its output included), so `previous_response_id` continues it on
any ingress replica: the next prompt extends the last one, and the router's prefix
affinity sends it where that prefix is cached.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import ValidationError

from ..chat import ChatBuilder
from ..errors import APIError, error_body, to_api_error, validation_error
from ..fanout import RequestStream
from ..fields import RESPONSES_FIELDS, refuse_unsupported
from ..protocol import ChatCompletionRequest
from ..serving import Serving
from .protocol import ResponsesRequest
from .store import ResponseStore, StoredResponse

# Chat request fields as the Responses API names them (for the `param` of an error).
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "prompt": "input",
}


def owner_of(authorization: str | None) -> str:
    """Whose stored responses a request may see: its API key's digest."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


def _renamed(err: APIError) -> APIError:
    if err.param is not None:
        head, _, rest = err.param.partition(".")
        err.param = _PARAMS.get(err.param) or (
            _PARAMS.get(head, head) + ("." + rest if rest else "")
        )
    return err


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputAssembler:
    """Output items from a chat stream's choices, and the Responses events they make."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # open function calls, by call index
        self.sequence = 0
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def feed(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        delta = choice["delta"]
        out: list[dict[str, Any]] = []
        if delta.get("content"):
            out += self._text(delta["content"])
        for part in delta.get("tool_calls", ()):
            out += self._call_part(part)
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
            out += self.close()
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._message is None:
            out += self._close_calls()
            out += self._open_message()
        msg = self._message
        assert msg is not None
        msg["content"][0]["text"] += text
        where = {"item_id": msg["id"], "output_index": self.items.index(msg), "content_index": 0}
        return [*out, self.event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict[str, Any]]:
        msg = {"type": "message", "id": _new_id("msg"), "status": "in_progress"}
        msg |= {"role": "assistant", "content": []}
        self.items.append(msg)
        self._message = msg
        added = self.event(
            "response.output_item.added",
            output_index=len(self.items) - 1,
            item=dict(msg, content=[]),
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        msg["content"].append(part)
        where = {"item_id": msg["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [added, self.event("response.content_part.added", **where, part=dict(part))]

    def _close_message(self) -> list[dict[str, Any]]:
        msg, self._message = self._message, None
        if msg is None:
            return []
        msg["status"] = "completed"
        part = msg["content"][0]
        where = {"item_id": msg["id"], "output_index": self.items.index(msg), "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **where, part=dict(part)),
            self.event("response.output_item.done", output_index=where["output_index"], item=msg),
        ]

    def _call_part(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fn = part.get("function", {})
        if part.get("id") is not None:
            out += self._close_message()
            call = {"type": "function_call", "id": _new_id("fc"), "call_id": part["id"]}
            call |= {"name": fn.get("name", ""), "arguments": "", "status": "in_progress"}
            self.items.append(call)
            self._calls[part["index"]] = call
            out.append(
                self.event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=dict(call)
                )
            )
        call = self._calls[part["index"]]
        if fn.get("arguments"):
            call["arguments"] += fn["arguments"]
            where = {"item_id": call["id"], "output_index": self.items.index(call)}
            out.append(
                self.event("response.function_call_arguments.delta", **where, delta=fn["arguments"])
            )
        return out

    def _close_calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for call in self._calls.values():
            call["status"] = "completed"
            where = {"item_id": call["id"], "output_index": self.items.index(call)}
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=call["name"],
                    arguments=call["arguments"],
                )
            )
            out.append(
                self.event(
                    "response.output_item.done", output_index=where["output_index"], item=call
                )
            )
        self._calls.clear()
        return out

    def close(self) -> list[dict[str, Any]]:
        return self._close_message() + self._close_calls()

    def as_message(self) -> dict[str, Any]:
        """The output as the assistant's chat message (for the stored conversation)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        return message | ({"tool_calls": calls} if calls else {})


class ResponsesServing:
    """Create, retrieve and delete responses for one ingress replica."""

    def __init__(self, serving: Serving, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def _history(self, owner: str, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        prev = await self.store.get(owner, req.previous_response_id)
        if prev is None:
            raise APIError(
                404,
                f"Previous response with id '{req.previous_response_id}' not found.",
                "previous_response_id",
            )
        return prev.history

    def _chat_request(
        self, req: ResponsesRequest, messages: list[dict[str, Any]]
    ) -> ChatCompletionRequest:
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            return ChatCompletionRequest.model_validate(
                {**req.chat_fields(), "messages": system + messages}
            )
        except ValidationError as e:
            raise _renamed(validation_error(e.errors())) from None

    async def create(self, req: ResponsesRequest, owner: str, arrived: float) -> Any:
        self.serving.check_model(req.model)
        refuse_unsupported(req.model_extra, RESPONSES_FIELDS)
        history = await self._history(owner, req) + req.input_messages()
        chat_req = self._chat_request(req, history)
        try:
            prep = await self.serving.prepare_chat(chat_req)
        except APIError as e:
            raise _renamed(e) from None
        run = _Run(self, req, owner, history, _new_id("resp"))
        builder = ChatBuilder(self.serving, chat_req, run.id, int(time.time()), prep)
        deltas = self.serving.start(prep, run.id, arrived)
        await deltas.admit()
        if req.stream:
            return EventSourceResponse(run.events(builder, deltas))
        return await run.answer(builder, deltas)

    async def retrieve(self, owner: str, response_id: str) -> dict[str, Any]:
        stored = await self.store.get(owner, response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return stored.body

    async def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        if not await self.store.delete(owner, response_id):
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Run:
    """One response being made: its output, its body, and its storing."""

    def __init__(
        self,
        responses: ResponsesServing,
        req: ResponsesRequest,
        owner: str,
        history: list[dict[str, Any]],
        rid: str,
    ) -> None:
        self.responses = responses
        self.req = req
        self.owner = owner
        self.history = history
        self.id = rid
        self.created_at = int(time.time())
        self.output = OutputAssembler()

    def snapshot(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else {"type": "text"}
        )
        tool_choice = req.tool_choice or ("auto" if req.tools else "none")
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.responses.serving.model_name,
            "output": self.output.items if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": fmt},
            "store": req.store is not False,
            "metadata": req.metadata or {},
            "truncation": "disabled",
            "usage": usage,
        }

    def _final(self, builder: ChatBuilder) -> dict[str, Any]:
        status = "incomplete" if self.output.finish_reason == "length" else "completed"
        u = builder.usage()
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        }
        return self.snapshot(status, usage)

    async def _keep(self, body: dict[str, Any]) -> None:
        if self.req.store is not False:
            history = [*self.history, self.output.as_message()]
            await self.responses.store.put(self.id, StoredResponse(self.owner, body, history))

    async def _outputs(
        self, builder: ChatBuilder, deltas: RequestStream
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            async for i, d in deltas:
                for choice in await builder.add(i, d):
                    for ev in self.output.feed(choice):
                        yield ev
        finally:
            await deltas.aclose()

    async def answer(self, builder: ChatBuilder, deltas: RequestStream) -> dict[str, Any]:
        try:
            async for _ in self._outputs(builder, deltas):
                pass
        except Exception as e:
            raise to_api_error(e) from None
        final = self._final(builder)
        await self._keep(final)
        return final

    async def events(self, builder: ChatBuilder, deltas: RequestStream) -> AsyncIterator[bytes]:
        out = self.output
        yield _sse(out.event("response.created", response=self.snapshot("in_progress")))
        yield _sse(out.event("response.in_progress", response=self.snapshot("in_progress")))
        try:
            async for ev in self._outputs(builder, deltas):
                yield _sse(ev)
        except Exception as e:
            err = error_body(to_api_error(e))["error"]
            yield _sse(
                out.event("error", code=err["code"], message=err["message"], param=err["param"])
            )
            return
        final = self._final(builder)
        await self._keep(final)
        yield _sse(out.event(f"response.{final['status']}", response=final))


def _sse(event: dict[str, Any]) -> bytes:
    return format_sse_event(event=event["type"], data_str=json.dumps(event, ensure_ascii=False))
