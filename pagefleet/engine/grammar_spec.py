"""A constraint as llguidance's grammar text, and its validation (torch-free, no tokenizer).

`grammar_spec` turns a `StructuredOutputsParams` into the grammar definition an
`llguidance.LLMatcher` compiles; `validate` checks it the way llguidance does
before any tokenizer is involved (the regex parses, the Lark grammar names only
rules it defines, the schema's `$ref`s resolve and it uses only what llguidance
implements), so an ingress can refuse a bad constraint before sending it, and
the engine refuses it before queueing (`InputProcessor`). Neither loads torch or
a tokenizer: llguidance's Python package needs neither for this.

JSON is generated compact: no whitespace between tokens, "," and ":" as
separators (`JSON_DEFAULTS`). llguidance's own default lets whitespace run
anywhere between tokens, and a model that is unsure (or random) can then emit
whitespace for ever without breaking the grammar. A schema may still ask for
flexible whitespace itself with an `"x-guidance": {"whitespace_flexible": true}`
key: llguidance applies our defaults, then the schema's own options.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher

from .sampling_params import StructuredOutputsParams

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar definition (its JSON text) of a constraint; ValueError for
    a schema it cannot express at all."""
    kind = params.kind
    if kind == "json":
        if params.json == "false":
            raise ValueError("the schema false admits no value")
        # The schema true as {} (llguidance applies its options to object schemas only).
        schema = "{}" if params.json == "true" else params.json
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
    if kind == "choice":
        # Lark string literals take JSON's escapes: each choice is matched exactly.
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)  # type: ignore[union-attr]
        return LLMatcher.grammar_from_lark(lark)
    return LLMatcher.grammar_from_lark(params.grammar)  # type: ignore[arg-type]


def describe(params: StructuredOutputsParams, error: str) -> str:
    """The message a rejected constraint fails its request with: which constraint, and why."""
    what = {
        "json": "JSON schema",
        "json_object": "JSON object constraint",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }[params.kind]
    return f"structured outputs: invalid {what}: {error.strip()}"


def validate(params: StructuredOutputsParams) -> str | None:
    """None if llguidance accepts the constraint, else the message to fail its request with.

    Cheap (no tokenizer, no torch): what an ingress calls before sending. A
    grammar can still fail later against a model's vocabulary (a Lark token
    range past its last token id); the engine reports that when it compiles.
    """
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_spec(params))
    except (ValueError, TypeError) as e:  # a schema the JSON compiler cannot read at all
        return describe(params, str(e) or type(e).__name__)
    # Warnings (a schema keyword llguidance ignores, say) do not fail a request.
    return describe(params, messages[0] if messages else "rejected") if is_error else None


# The name the package exports it under (`pagefleet.engine.validate_structured_outputs`).
validate_structured_outputs = validate
