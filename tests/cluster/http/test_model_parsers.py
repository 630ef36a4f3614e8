"""Tool-call and reasoning parsers by model family, on each family's chat template and its
real output format, streamed token by token and whole; then over HTTP, where the
model's output is forced into the family's format by a grammar (random weights
write nothing else), streamed and not.

The tokenizers are the tiny test tokenizer with each family's special tokens added
and its chat template (`chat_templates/`: Llama 3.1 JSON, Llama 3.2 pythonic and
Mistral as vLLM's examples ship them, Qwen3's, gpt-oss's with its type rendering
shortened).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pagefleet.cluster.config import ChatSettings
from pagefleet.cluster.http.chat_parsing import ChoiceParser, Parsed
from pagefleet.cluster.http.model_tool_parsers import choose, tool_call_parser
from pagefleet.cluster.http.reasoning_parsers import reasoning_parser
from tests.cluster.http.test_api import ENGINE, Harness, serving
from tests.cluster.http.test_tool_parsers import joined
from tests.conftest import tokenizer_for

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ARGS = {"city": "Paris", "days": 2}

# family -> (template, special tokens, plain added tokens, parser, reasoning, output, calls, content, reasoning text)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3_json": {
        "template": "llama3.1_json.jinja",
        "special": [
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
            "<|eom_id|>",
        ],
        "output": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        "prompt_end": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    },
    "pythonic": {
        "template": "llama3.2_pythonic.jinja",
        "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "output": "[get_weather(city='Paris', days=2), get_weather(city='Rome')]",
        "calls": [ARGS, {"city": "Rome"}],
        "prompt_end": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    },
    "mistral": {
        "template": "mistral.jinja",
        "special": [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "output": 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
        "calls": [ARGS, {"city": "Rome"}],
        "content": "Checking. ",
        "prompt_end": "[/TOOL_RESULTS]",
    },
    "openai": {
        "template": "gpt_oss.jinja",
        "special": [
            "<|start|>",
            "<|message|>",
            "<|channel|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
            "<|constrain|>",
        ],
        "reasoning": "openai_gptoss",
        "output": "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "days": 2}',
        "thinking": "The user wants the weather.",
        "prompt_end": "<|start|>assistant",
    },
    "hermes": {
        "template": "qwen3.jinja",
        "plain": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
        "reasoning": "qwen3",
        "output": "<think>\nThe user wants the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>",
        "thinking": "\nThe user wants the weather.\n",
        "content": "\n\n",
        "prompt_end": "<|im_start|>assistant\n",
    },
}


def family_dir(llama_dir: str, root: Path, name: str, with_model: bool) -> str:
    """The tiny checkpoint's tokenizer with the family's tokens and template (and, with
    `with_model`, the model resized to the larger vocabulary, saved by transformers)."""
    f = FAMILIES[name]
    out = root / f"{name}-{'model' if with_model else 'tok'}"
    if out.exists():
        return str(out)
    tok = tokenizer_for(llama_dir).__class__.from_pretrained(llama_dir)
    tok.add_special_tokens({"additional_special_tokens": f.get("special", [])})
    tok.add_tokens(f.get("plain", []))
    tok.chat_template = (TEMPLATES / f["template"]).read_text()
    if with_model:
        from transformers import AutoModelForCausalLM

        shutil.copytree(llama_dir, out)
        model = AutoModelForCausalLM.from_pretrained(llama_dir)
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def pieces(tok: Any, text: str) -> list[str]:
    """The text as a stream would bring it: one piece per token (special tokens kept)."""
    ids = tok.encode(text, add_special_tokens=False)
    out, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tok.decode(ids[:i], skip_special_tokens=False)
        out.append(now[len(before) :])
        before = now
    assert "".join(out) == text
    return out


def parse(name: str, parts: list[str]) -> tuple[Parsed, ChoiceParser]:
    f = FAMILIES[name]
    parser = ChoiceParser(reasoning_parser(f.get("reasoning")), tool_call_parser(name))
    total = Parsed()
    for piece in [*parts, None]:
        got = parser.finish() if piece is None else parser.feed(piece)
        total.content += got.content
        total.reasoning += got.reasoning
        total.parts += got.parts
    return total, parser


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_chosen_from_its_template_and_its_calls_read_streamed_or_whole(
    llama_dir: str, root: Path, name: str
) -> None:
    from transformers import AutoTokenizer

    f = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(family_dir(llama_dir, root, name, with_model=False))
    assert choose(tok.chat_template) == name
    whole, parser = parse(name, [f["output"]])
    streamed, streamed_parser = parse(name, pieces(tok, f["output"]))
    # Streamed token by token, each call's arguments come in fragments as they are
    # written (pythonic's are Python, turned into JSON once the list is complete), and
    # join to exactly the call's arguments.
    calls = f.get("calls", [ARGS])
    per_call = [sum(p.index == i for p in streamed.parts) for i in range(len(calls))]
    assert all(n > (1 if name != "pythonic" else 0) for n in per_call), per_call
    assert [p.arguments for p in joined(streamed.parts)] == [
        c.arguments for c in streamed_parser.calls
    ]
    for got in (whole, streamed):
        assert [(p.name, json.loads(p.arguments)) for p in joined(got.parts)] == [
            ("get_weather", c) for c in calls
        ]
        assert got.content == f.get("content", "")
        assert got.reasoning == f.get("thinking", "")
    # The calls go back into the family's template as the next turn's history.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ARGS}}
                for c in parser.calls[:1]
            ],
        },
        {"role": "tool", "tool_call_id": parser.calls[0].id, "content": "sunny"},
    ]
    prompt = tok.apply_chat_template(
        history, tools=[TOOL], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(f["prompt_end"]) and "get_weather" in prompt and "sunny" in prompt
    if name == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in parser.calls)


def test_content_without_calls_stays_content(llama_dir: str, root: Path) -> None:
    for name, text in [
        ("llama3_json", "It is sunny in Paris."),
        ("pythonic", "It is sunny [really]."),
        ("mistral", "No call [TOOL_C here."),
    ]:
        got, parser = parse(name, list(text))
        assert got.content == text and not parser.calls, name


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "thinking here</think>The answer.", "thinking here", "The answer."),
        ("deepseek_r1", "<think>cut short", "cut short", ""),
        ("qwen3", "<think>\nhm\n</think>\n\nYes.", "\nhm\n", "\n\nYes."),
        ("qwen3", "Yes, no thinking.", "", "Yes, no thinking."),
        (
            "openai_gptoss",
            "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final"
            "<|message|>Yes.",
            "hm",
            "<|start|>assistant<|channel|>final<|message|>Yes.",
        ),
    ],
)
def test_reasoning_parsers_split_however_the_text_is_cut(
    name: str, text: str, reasoning: str, content: str
) -> None:
    for cut in [[text], list(text), *([text[:k], text[k:]] for k in range(1, len(text)))]:
        parser = reasoning_parser(name)
        assert parser is not None
        got = [parser.feed(p) for p in cut] + [parser.finish()]
        assert "".join(r for r, _ in got) == reasoning, cut
        assert "".join(a for _, a in got) == content, cut


# -- over HTTP ------------------------------------------------------------------------


def grammar(name: str, tok: Any) -> str:
    """A Lark grammar whose only sentence is the family's output (added tokens by id)."""
    text = FAMILIES[name]["output"]
    specials = FAMILIES[name].get("special", []) + FAMILIES[name].get("plain", [])
    parts, rest = [], text
    while rest:
        hit = min(((rest.find(s), s) for s in specials if s in rest), default=None)
        if hit is None or hit[0] > 0:
            end = len(rest) if hit is None else hit[0]
            parts.append(json.dumps(rest[:end]))
            rest = rest[end:]
        else:
            parts.append(f"<[{tok.convert_tokens_to_ids(hit[1])}]>")
            rest = rest[len(hit[1]) :]
    return "start: " + " ".join(parts)


@pytest.fixture(scope="module", params=["llama3_json", "openai", "hermes", "mistral", "pythonic"])
def family(request: pytest.FixtureRequest, llama_dir: str, root: Path) -> Iterator[Harness]:
    path = family_dir(llama_dir, root, request.param, with_model=True)
    # qwen3's grammar would wait for the model's own `</think>` (a random model writes
    # none): over HTTP the hermes family's calls are read without a reasoning parser.
    reasoning = FAMILIES[request.param].get("reasoning")
    settings = ChatSettings(reasoning_parser=None if reasoning == "qwen3" else reasoning)
    engine = {**ENGINE, "num_kv_blocks": 128, "max_model_len": 1024}
    with serving(path, {"engine": engine}, chat_settings=settings) as h:
        h.family = request.param  # type: ignore[attr-defined]
        h.tok = tokenizer_for(path)  # type: ignore[attr-defined]
        yield h


def _http_thinking(name: str) -> str | None:
    return None if FAMILIES[name].get("reasoning") == "qwen3" else FAMILIES[name].get("thinking")


def _request(h: Harness, stream: bool) -> dict[str, Any]:
    name = h.family  # type: ignore[attr-defined]
    return {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [TOOL],
        "temperature": 0,
        "max_tokens": 200,
        "guided_grammar": grammar(name, h.tok),  # type: ignore[attr-defined]
        "stream": stream,
    }


def test_calls_over_http_unstreamed(family: Harness) -> None:
    name = family.family  # type: ignore[attr-defined]
    r = family.client.post("/v1/chat/completions", json=_request(family, False))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    expected = FAMILIES[name].get("calls", [ARGS])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == expected
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"].get("reasoning_content") == _http_thinking(name)


def test_calls_over_http_streamed(family: Harness) -> None:
    """The official `openai` client's stream, accumulated as OpenAI documents: a call's
    first delta has its id, type and name, the next ones more `arguments` under its index;
    they join to exactly the unstreamed answer's arguments."""
    name = family.family  # type: ignore[attr-defined]
    body = _request(family, True)
    extra = {"guided_grammar": body.pop("guided_grammar")}
    client = openai.OpenAI(base_url=f"{family.url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="tiny", **body, extra_body=extra)
    calls: dict[int, dict[str, Any]] = {}
    deltas: dict[int, int] = {}
    thinking, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        thinking += getattr(choice.delta, "reasoning_content", None) or ""
        for t in choice.delta.tool_calls or []:
            deltas[t.index] = deltas.get(t.index, 0) + 1
            if t.index not in calls:
                assert t.id and t.type == "function" and t.function and t.function.name
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
            else:
                assert t.id is None and t.function is not None and t.function.name is None
            calls[t.index]["arguments"] += (t.function and t.function.arguments) or ""
    whole = family.client.post("/v1/chat/completions", json=_request(family, False)).json()
    expected = [c["function"] for c in whole["choices"][0]["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c["name"], c["arguments"]) for c in expected
    ]
    assert [json.loads(c["arguments"]) for c in expected] == FAMILIES[name].get("calls", [ARGS])
    assert all(n > 1 for n in deltas.values()) or name == "pythonic", deltas
    assert thinking == (_http_thinking(name) or "")
    assert finish == "tool_calls"
    family.check_idle_and_balanced()


def test_template_inputs_reach_the_template(family: Harness) -> None:
    """Qwen3's `enable_thinking` and gpt-oss's `reasoning_effort` change the prompt."""
    name = family.family  # type: ignore[attr-defined]
    if name not in ("hermes", "openai"):
        pytest.skip("the template reads neither")
    extra: dict[str, Any] = (
        {"chat_template_kwargs": {"enable_thinking": False}}
        if name == "hermes"
        else {"reasoning_effort": "low"}
    )
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "return_token_ids": True,
        **extra,
    }
    r = family.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt = family.tok.decode(r.json()["prompt_token_ids"])  # type: ignore[attr-defined]
    if name == "hermes":
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert "Reasoning: low" in prompt


def test_the_choice_is_logged_once_and_a_setting_wins(
    llama_dir: str, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoTokenizer

    from pagefleet.cluster.config import Limits
    from pagefleet.cluster.http.serving import Serving
    from pagefleet.cluster.http.tokenizer import AsyncTokenizer

    tok = AutoTokenizer.from_pretrained(family_dir(llama_dir, root, "openai", with_model=False))
    with caplog.at_level("INFO", logger="pagefleet.http"):
        serving = Serving(None, AsyncTokenizer(tok), "m", Limits())  # type: ignore[arg-type]
    assert (serving.tool_call_parser, serving.reasoning_parser) == ("openai", "openai_gptoss")
    lines = [r.getMessage() for r in caplog.records if "tool_call_parser" in r.getMessage()]
    assert lines == ["tool_call_parser: openai (chosen from the chat template)"]
    caplog.clear()
    settings = ChatSettings(tool_call_parser="hermes", reasoning_parser="qwen3")
    with caplog.at_level("INFO", logger="pagefleet.http"):
        serving = Serving(None, AsyncTokenizer(tok), "m", Limits(), chat=settings)  # type: ignore[arg-type]
    assert (serving.tool_call_parser, serving.reasoning_parser) == ("hermes", "qwen3")
    assert not [r for r in caplog.records if "tool_call_parser" in r.getMessage()]


def test_gpt_oss_channels_without_tools(family: Harness) -> None:
    if family.family != "openai":  # type: ignore[attr-defined]
        pytest.skip("gpt-oss only")
    tok = family.tok  # type: ignore[attr-defined]
    ids = {t: tok.convert_tokens_to_ids(t) for t in FAMILIES["openai"]["special"]}
    lark = (
        f'start: <[{ids["<|channel|>"]}]> "analysis" <[{ids["<|message|>"]}]> "hm"'
        f' <[{ids["<|end|>"]}]> <[{ids["<|start|>"]}]> "assistant" <[{ids["<|channel|>"]}]>'
        f' "final" <[{ids["<|message|>"]}]> "Yes."'
    )
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "guided_grammar": lark,
    }
    message = family.client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hm", "Yes.")


def test_grammars_apply_to_the_answer_after_the_reasoning(llama_dir: str, root: Path) -> None:
    """deepseek_r1 (reasoning open after the prompt): the model's first token, pushed to
    `</think>`, is free; the grammar shapes what follows, for a guided choice and a
    named tool's arguments alike."""
    path = family_dir(llama_dir, root, "hermes", with_model=True)
    close = tokenizer_for(path).convert_tokens_to_ids("</think>")
    settings = ChatSettings(reasoning_parser="deepseek_r1")
    engine = {**ENGINE, "num_kv_blocks": 128, "max_model_len": 1024}
    base = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "temperature": 0,
        "max_tokens": 60,
        "logit_bias": {str(close): 100},
        "return_token_ids": True,
    }
    with serving(path, {"engine": engine}, chat_settings=settings) as h:
        r = h.client.post("/v1/chat/completions", json={**base, "guided_choice": ["yes", "no"]})
        body = r.json()
        assert body["choices"][0]["token_ids"][0] == close
        assert body["choices"][0]["message"]["content"] in ("yes", "no")
        schema = {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        }
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = h.client.post(
            "/v1/chat/completions", json={**base, "tools": [tool], "tool_choice": named}
        )
        choice = r.json()["choices"][0]
        assert choice["token_ids"][0] == close
        args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert args in ({"city": "Paris"}, {"city": "Rome"})


def test_qwen3_grammars_apply_to_the_answer_whether_it_thinks_or_not(
    llama_dir: str, root: Path
) -> None:
    """qwen3 with thinking on: the prompt leaves the model to open `<think>` itself, and it
    may skip it. The first token is the grammar's or `<think>`: an answer that opens with
    `<think>` is free until `</think>` and shaped after it; one that skips it is shaped
    from its first token (it used to wait for a `</think>` that never came). With
    `enable_thinking: false` the template closes an empty block in the prompt and the
    grammar shapes the text from its first token."""
    path = family_dir(llama_dir, root, "hermes", with_model=True)
    tok = tokenizer_for(path)
    think, close = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    settings = ChatSettings(reasoning_parser="qwen3")
    engine = {**ENGINE, "num_kv_blocks": 128, "max_model_len": 1024}
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    base: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "temperature": 0,
        "max_tokens": 40,
        "return_token_ids": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    }
    skips = {**base, "logit_bias": {str(think): -100, str(close): -100}}
    thinks = {**base, "logit_bias": {str(think): 50, str(close): 100}}
    off = {**skips, "chat_template_kwargs": {"enable_thinking": False}}
    with serving(path, {"engine": engine}, chat_settings=settings) as h:
        for body in (skips, off):
            choice = h.client.post("/v1/chat/completions", json=body).json()["choices"][0]
            assert think not in choice["token_ids"] and choice["finish_reason"] == "stop"
            assert json.loads(choice["message"]["content"])["city"] in ("Paris", "Rome")
            assert choice["message"].get("reasoning_content") is None
        choice = h.client.post("/v1/chat/completions", json=thinks).json()["choices"][0]
        assert choice["token_ids"][:2] == [think, close] and choice["finish_reason"] == "stop"
        assert json.loads(choice["message"]["content"])["city"] in ("Paris", "Rome")
        streamed = {**skips, "stream": True}
        with h.client.stream("POST", "/v1/chat/completions", json=streamed) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: {")]
        deltas = [json.loads(x)["choices"][0]["delta"] for x in lines]
        content = "".join(d.get("content") or "" for d in deltas)
        assert json.loads(content)["city"] in ("Paris", "Rome")
        assert not any(d.get("reasoning_content") for d in deltas)
