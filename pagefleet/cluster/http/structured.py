"""A request's output constraint, read from whichever field gave it.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs`
object all say the same thing: the engine's `StructuredOutputsParams`. A request
gives at most one of them (two would have to agree, and nothing says which wins);
`response_format: {"type": "text"}` asks for nothing. What the grammar library
rejects (a schema it cannot compile) is found by `serving.py` before the request
is queued; what is wrong in the shape alone is found here, and so is a constraint
past the configured sizes (`check_size`: the number and bytes of choices, the
bytes of a regex, grammar or schema), before anything compiles it. Every error
names the field, as OpenAI's do.
"""

from __future__ import annotations

from typing import Any

from pagefleet.engine import StructuredOutputsParams

from ..config import Limits
from .errors import APIError
from .protocol import StructuredOutputFields


def _params(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param) from None


def _response_format(req: StructuredOutputFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _params("response_format", json_object=True)
    assert fmt.json_schema is not None  # the model's own check
    if fmt.json_schema.json_schema is None:
        raise APIError(
            400, "response_format.json_schema needs a schema", "response_format.json_schema"
        )
    return _params("response_format", json=fmt.json_schema.json_schema)


def _structured_outputs(req: StructuredOutputFields) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None or not so.has_constraint:
        return None  # absent, or options only (for a response_format beside it)
    return _params(
        "structured_outputs",
        json=so.json_value,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
    )


def constraint_of(req: StructuredOutputFields) -> tuple[str, StructuredOutputsParams] | None:
    """The request's constraint and the field that gave it; None for free text."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    if (p := _response_format(req)) is not None:
        given.append(("response_format", p))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            given.append((name, _params(name, **{kind: value})))
    if (p := _structured_outputs(req)) is not None:
        given.append(("structured_outputs", p))
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise APIError(400, f"give one output constraint, not several ({names})", given[1][0])
    return given[0] if given else None


def check_size(param: str, constraint: StructuredOutputsParams, limits: Limits) -> None:
    """A 400 naming `param` for a constraint past the configured sizes."""
    if constraint.choice is not None:
        count, size = len(constraint.choice), sum(len(c.encode()) for c in constraint.choice)
        if count > limits.max_choices:
            raise APIError(
                400,
                f"{param}: {count} choices exceed the limit of {limits.max_choices} (max_choices)",
                param,
            )
        if size > limits.max_choice_bytes:
            raise APIError(
                400,
                f"{param}: the choices take {size} bytes, more than the limit of "
                f"{limits.max_choice_bytes} (max_choice_bytes)",
                param,
            )
        return
    text = constraint.json or constraint.regex or constraint.grammar or ""
    size = len(text.encode())
    if size > limits.max_grammar_bytes:
        raise APIError(
            400,
            f"{param}: the {constraint.kind} takes {size} bytes, more than the limit of "
            f"{limits.max_grammar_bytes} (max_grammar_bytes)",
            param,
        )
