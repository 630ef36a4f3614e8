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

Choices are one Lark terminal, an alternation of the choices as string
literals (JSON's escapes: each is matched exactly): one lexeme, which llguidance
compiles about as fast as a JSON enum, where one rule of N literals is N
lexemes (a rule of 30,000 took seconds to check).

Every matcher is built under `GRAMMAR_LIMITS`, llguidance's resource limits with
the initial lexer fuel at a fifth of its default: it bounds what building a
constraint's lexer may cost in time and memory. A constraint that exhausts it
(a counted repetition nested in another, `(a{1000}){1000}`) does so only when
its lexer first moves past the start, so the check against a vocabulary
(`check_matcher`) computes the first mask, consumes the first token it allows
on a copy and computes the next one: such a constraint fails there, before it
is cached or queued, instead of on the step loop. Without a tokenizer
(`validate(params)`) the check is llguidance's syntax check alone.

An error's message is one line (`first_line`): llguidance's messages quote the
input on indented lines and may go on with parser state, and a panic's with a
backtrace.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from .sampling_params import StructuredOutputsParams

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
INITIAL_LEXER_FUEL = 200_000
GRAMMAR_LIMITS = LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


def choice_lark(choices: tuple[str, ...] | list[str]) -> str:
    """The Lark grammar matching exactly one of `choices` (see the module docstring)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def first_line(message: str) -> str:
    """An error's own words on one line: its lines that start at the margin, up to the
    first tagged block (`<backtrace>`, `<state>`); indented lines quote the input."""
    words = []
    for line in message.splitlines():
        if line.startswith("<"):
            break
        if line.strip() and not line[0].isspace():
            words.append(line.strip())
    return " ".join(words) or "rejected"


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
        return LLMatcher.grammar_from_lark(choice_lark(params.choice))  # type: ignore[arg-type]
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
    return f"structured outputs: invalid {what}: {first_line(error)}"


def validate(params: StructuredOutputsParams, tokenizer: LLTokenizer | None = None) -> str | None:
    """None if llguidance accepts the constraint, else the message to fail its request with.

    Without `tokenizer`: llguidance's syntax check (no torch), which the engine
    makes before queueing. With it: the constraint is built against that
    vocabulary under `GRAMMAR_LIMITS` and moved one token (`check_matcher`), so
    what would fail at compile, or on the first token, fails here.
    """
    try:
        spec = grammar_spec(params)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            spec, tokenizer, limits=GRAMMAR_LIMITS
        )
    except (ValueError, TypeError) as e:  # a schema the JSON compiler cannot read at all
        return describe(params, str(e) or type(e).__name__)
    # Warnings (a schema keyword llguidance ignores, say) do not fail a request.
    if is_error:
        return describe(params, messages[0] if messages else "rejected")
    if tokenizer is None:
        return None
    error = check_matcher(LLMatcher(tokenizer, spec, log_level=0, limits=GRAMMAR_LIMITS))
    return None if error is None else describe(params, error)


def check_matcher(matcher: LLMatcher) -> str | None:
    """None if a fresh matcher computes its first mask and, on a copy, takes the first
    token that mask allows and computes the next; else llguidance's error. The matcher
    itself keeps only its first mask's lexer states."""
    if not matcher.is_error():
        mask = matcher.compute_bitmask()
        token = _first_allowed(mask)
        probe = matcher.deep_copy()
        if token is not None and probe.consume_token(token) and not probe.is_stopped():
            probe.compute_bitmask()
        if probe.is_error():
            return probe.get_error()
    return matcher.get_error() if matcher.is_error() else None


def _first_allowed(mask: bytes) -> int | None:
    """The lowest token id set in llguidance's bitmask (32 tokens per little-endian word)."""
    for i, byte in enumerate(mask):
        if byte:
            return i * 8 + (byte & -byte).bit_length() - 1
    return None


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: list[int]) -> LLTokenizer:
    """llguidance's view of a vocabulary from a Hugging Face fast tokenizer's JSON (about
    a second for a 50k vocabulary), as `llguidance.hf.from_tokenizer` builds it."""
    spec = json.loads(tokenizer_json)
    spec["padding"] = spec["truncation"] = None  # what encoding the prompt may set
    return LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos or None)


# The name the package exports it under (`pagefleet.engine.validate_structured_outputs`).
validate_structured_outputs = validate
