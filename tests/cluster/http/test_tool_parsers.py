"""Tool-call parsers over text that arrives in pieces: a streamed answer (any split of
the text) holds exactly the calls and content of the whole text parsed at once."""

from __future__ import annotations

import json

import pytest

from pagefleet.cluster.http.tool_parsers import (
    CallListParser,
    CallPart,
    HermesParser,
    NamedParser,
    ToolCallParser,
    json_depth_exceeds,
    loads_bounded,
)

HERMES = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <b>", "n": 2}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CALLS = [
    ("get_weather", {"city": "Paris <b>", "n": 2}),
    ("get_time", {}),
]


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[CallPart]]:
    content, parts = "", []
    for piece in pieces:
        c, p = parser.feed(piece)
        content, parts = content + c, parts + p
    c, p = parser.finish()
    return content + c, parts + p


def splits(text: str) -> list[list[str]]:
    """The text whole, in single characters, and cut in two at every point."""
    return [[text], list(text), *([text[:k], text[k:]] for k in range(1, len(text)))]


def calls_of(parser: ToolCallParser) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.calls]


@pytest.mark.parametrize("pieces", splits(HERMES))
def test_hermes_finds_the_same_calls_however_the_text_is_cut(pieces: list[str]) -> None:
    parser = HermesParser()
    content, parts = run(parser, pieces)
    assert content == "Let me check.\n"
    assert calls_of(parser) == CALLS
    # One part per call, carrying its id, name and whole arguments.
    assert [(p.index, p.name, json.loads(p.arguments)) for p in parts] == [
        (i, name, args) for i, (name, args) in enumerate(CALLS)
    ]
    assert [p.id for p in parts] == [c.id for c in parser.calls]
    assert all(p.id and p.id.startswith("call_") for p in parts)


def test_hermes_holds_back_only_what_could_open_a_call() -> None:
    parser = HermesParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box>") == ("<toolbox>", [])  # it was not a call after all
    assert parser.finish() == ("", [])
    parser = HermesParser()
    assert parser.feed("x <tool_c") == ("x ", [])
    assert parser.finish() == ("<tool_c", [])  # the end: what was held is content


def test_hermes_keeps_a_block_that_is_not_a_call_as_content_and_an_open_one_at_the_end() -> None:
    parser = HermesParser()
    text = '<tool_call>not json</tool_call> then <tool_call>{"name": "f"'
    assert run(parser, [text]) == (
        '<tool_call>not json</tool_call> then <tool_call>{"name": "f"',
        [],
    )
    assert parser.calls == []


def test_hermes_with_one_call_allowed_keeps_the_first() -> None:
    parser = HermesParser(parallel=False)
    _, parts = run(parser, [HERMES])
    assert calls_of(parser) == CALLS[:1]
    assert len(parts) == 1


CALL_LIST = (
    '[{"name": "get_weather", "parameters": {"city": "a}b\\"{", "n": 2}}, '
    '{"name": "get_time", "parameters": {}}]'
)


@pytest.mark.parametrize("pieces", splits(CALL_LIST))
def test_call_list_finds_each_call_once_it_closes(pieces: list[str]) -> None:
    parser = CallListParser()
    content, parts = run(parser, pieces)
    assert content == ""
    assert calls_of(parser) == [("get_weather", {"city": 'a}b"{', "n": 2}), ("get_time", {})]
    assert [p.index for p in parts] == [0, 1]


def test_call_list_cut_short_is_content() -> None:
    parser = CallListParser()
    assert run(parser, ['[{"name": "get_weather", "para']) == (
        '[{"name": "get_weather", "para',
        [],
    )


def test_named_every_piece_is_more_arguments() -> None:
    parser = NamedParser(name="f")
    content, parts = run(parser, ['{"a"', ": 1", "}"])
    assert content == ""
    assert [(p.index, p.name, p.arguments) for p in parts] == [
        (0, "f", '{"a"'),
        (0, None, ": 1"),
        (0, None, "}"),
    ]
    assert parts[0].id == parser.calls[0].id and parts[1].id is None
    assert calls_of(parser) == [("f", {"a": 1})]


def test_a_call_nested_past_max_depth_stays_content() -> None:
    deep = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    text = f"<tool_call>{deep}</tool_call>"
    parser = HermesParser(max_depth=64)
    assert run(parser, [text]) == (text, []) and parser.calls == []
    shallow = '{"name": "f", "arguments": {"a": [[1]]}}'
    assert run(HermesParser(max_depth=4), [f"<tool_call>{shallow}</tool_call>"])[0] == ""
    items = CallListParser(max_depth=64)
    whole = '[{"name": "f", "parameters": ' + "[" * 5000 + "]" * 5000 + "}]"
    assert run(items, list(whole)) == (whole, []) and items.calls == []


def test_an_unclosed_block_of_many_pieces_comes_back_whole() -> None:
    pieces = ["<tool_call>", *(["{", '"x', "y"] * 30000)]
    content, parts = run(HermesParser(), pieces)
    assert content == "".join(pieces) and parts == []
    listed = ["[", *(['{"name": "f", "parameters": {}}', ","] * 20000), '{"name"']
    parser = CallListParser()
    content, parts = run(parser, listed)
    assert len(parts) == 20000 and content == ""


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert not json_depth_exceeds('{"a": "[[[[[[[[", "b": [1, {"c": 2}]}', 3)
    assert json_depth_exceeds('{"a": [[[1]]]}', 3)
    assert not json_depth_exceeds('{"a": [[1]]}', 3)
    assert not json_depth_exceeds('"\\"[[[["', 1)
    with pytest.raises(ValueError, match="JSON nested more than 2 levels deep"):
        loads_bounded("[[[]]]", 2)
    assert loads_bounded("[[1]]", 2) == [[1]]
