"""A `StructuredOutputsParams` as llguidance grammar text, and whether llguidance takes it.

Torch-free and tokenizer-free: the ingress checks a request's constraint with it
before anything is queued (a schema the library rejects is a 400 naming the field),
and the engine compiles the same text against its tokenizer.

JSON is generated compact (`whitespace_flexible` off: `", "` and `": "` separators, no
free whitespace), so the grammar alone bounds the output's shape: with free
whitespace a model can spend its whole budget on blanks between two tokens. A
choice is a Lark alternation of the strings, each a JSON-quoted literal.
"""

from __future__ import annotations

import json

import llguidance

from .sampling_params import StructuredOutputsParams

_JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its serialized top-level form) of one constraint."""
    matcher = llguidance.LLMatcher
    kind = params.kind
    if kind == "json":
        return matcher.grammar_from_json_schema(params.json, defaults=_JSON_DEFAULTS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS)
    if kind == "regex":
        return matcher.grammar_from_regex(params.regex)
    if kind == "choice":
        choices = params.choice or ()
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return matcher.grammar_from_lark(params.grammar)


def structured_output_error(params: StructuredOutputsParams) -> str | None:
    """Why llguidance rejects the constraint, or None when it takes it."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_of(params))
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)
    return error or None
