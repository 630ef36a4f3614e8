"""Tool-call parsers over text that arrives in pieces: a streamed answer (any split of
the text) holds exactly the calls and content of the whole text parsed at once, and
each call streams as OpenAI's do: a first part with its id and name, then its
arguments in fragments as they are written, which join to the call's arguments."""

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


def joined(parts: list[CallPart]) -> list[CallPart]:
    """Each call's parts as one: its first part names it, the others only add arguments
    (OpenAI's streamed `tool_calls` deltas, accumulated as its SDK does)."""
    calls: list[CallPart] = []
    for p in parts:
        if p.id is not None:
            assert p.index == len(calls) and p.name
            calls.append(CallPart(p.index, p.arguments, p.id, p.name))
        else:
            assert p.name is None and p.index == len(calls) - 1 and p.arguments
            calls[-1].arguments += p.arguments
    return calls


def test_arguments_stream_as_they_are_written() -> None:
    parser = HermesParser()
    text = '<tool_call>{"name": "f", "arguments": {"city": "Paris", "n": [1, 2]}}</tool_call>'
    _, parts = run(parser, list(text))
    assert parts[0] == CallPart(0, "{", parser.calls[0].id, "f")
    assert "".join(p.arguments for p in parts) == '{"city": "Paris", "n": [1, 2]}'
    assert len(parts) == len('{"city": "Paris", "n": [1, 2]}')


@pytest.mark.parametrize("pieces", splits(HERMES))
def test_hermes_finds_the_same_calls_however_the_text_is_cut(pieces: list[str]) -> None:
    parser = HermesParser()
    content, parts = run(parser, pieces)
    assert content == "Let me check.\n"
    assert calls_of(parser) == CALLS
    # Each call's parts join to its id, name and arguments as written.
    calls = joined(parts)
    assert [(p.index, p.id, p.name, p.arguments) for p in calls] == [
        (i, c.id, c.name, c.arguments) for i, c in enumerate(parser.calls)
    ]
    assert [c.arguments for c in parser.calls] == ['{"city": "Paris <b>", "n": 2}', "{}"]
    assert all(p.id and p.id.startswith("call_") for p in calls)


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
    assert len(joined(parts)) == 1


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
    calls = joined(parts)
    assert [(p.id, p.arguments) for p in calls] == [(c.id, c.arguments) for c in parser.calls]


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


def test_a_call_nested_past_max_depth_is_cut_where_it_passes_it() -> None:
    """Arguments stream as they are written, so a call is out before its depth is known:
    past `max_depth` its arguments end (what follows in the call is not read)."""
    deep = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    text = f"<tool_call>{deep}</tool_call>"
    parser = HermesParser(max_depth=64)
    _, parts = run(parser, [text])
    assert [c.arguments for c in joined(parts)] == ["[" * 63]
    assert [c.arguments for c in parser.calls] == ["[" * 63]  # not JSON: the client sees the cut
    shallow = '{"name": "f", "arguments": {"a": [[1]]}}'
    parser = HermesParser(max_depth=4)
    assert run(parser, [f"<tool_call>{shallow}</tool_call>"])[0] == ""
    assert calls_of(parser) == [("f", {"a": [[1]]})]
    items = CallListParser(max_depth=64)
    whole = '[{"name": "f", "parameters": ' + "[" * 5000 + "]" * 5000 + "}]"
    _, parts = run(items, list(whole))
    assert [c.arguments for c in joined(parts)] == ["[" * 63]


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


FAMILY_OUTPUTS = {
    "llama3_json": (
        '<|python_tag|>{"name": "f", "parameters": {"a": "x;y", "b": [1]}}; '
        '{"name": "g", "parameters": {}}',
        "",
    ),
    "mistral": ('Sure. [TOOL_CALLS]f[ARGS]{"a": "x;y", "b": [1]}[TOOL_CALLS]g[ARGS]{}', "Sure. "),
    "openai": (
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": "x;y", "b": [1]}'
        "<|call|><|start|>assistant to=functions.g<|channel|>commentary<|message|>{}",
        "",
    ),
}


@pytest.mark.parametrize("name", sorted(FAMILY_OUTPUTS))
def test_model_parsers_stream_each_call_as_written_however_the_text_is_cut(name: str) -> None:
    from pagefleet.cluster.http.model_tool_parsers import tool_call_parser

    text, content = FAMILY_OUTPUTS[name]
    for pieces in [list(text), *splits(text)[::7]]:
        parser = tool_call_parser(name)
        got, parts = run(parser, pieces)
        assert got == content
        calls = joined(parts)
        assert [(c.name, c.arguments) for c in calls] == [
            ("f", '{"a": "x;y", "b": [1]}'),
            ("g", "{}"),
        ]
        assert [(c.id, c.arguments) for c in calls] == [(c.id, c.arguments) for c in parser.calls]
    _, parts = run(tool_call_parser(name), list(text))
    assert sum(p.index == 0 for p in parts) > 10  # one fragment a character


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"arguments": {"a": 1}, "name": "f"}', '{"a": 1}'),  # the name last: all at once
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),  # a JSON string, decoded
        ('{"name": "f"}', "{}"),  # no arguments
        ('{"name": "f", "arguments": {"s": "}{\\"]"}}', '{"s": "}{\\"]"}'),
    ],
)
def test_a_call_object_in_any_key_order_or_form(body: str, arguments: str) -> None:
    for pieces in ([body], list(body)):
        parser = HermesParser()
        content, parts = run(parser, ["<tool_call>", *pieces, "</tool_call>"])
        assert content == ""
        assert [(c.name, c.arguments) for c in joined(parts)] == [("f", arguments)]
        assert [(c.name, c.arguments) for c in parser.calls] == [("f", arguments)]
