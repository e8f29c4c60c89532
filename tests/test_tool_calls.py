"""Tool calls through the Python API (engine/tools/): each family's own chat template renders the tools
and the calls, its parser reads back what the template writes, `required` and a named function force a
call that parses and validates on random weights, and a stream's pieces join to the final content."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tool_models import FAMILIES, write_tool_model
from transformers import AutoTokenizer

import moestream
from moestream.engine.tools import ToolSession, format_for
from moestream.errors import MoestreamError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "The sum of two numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = [
    {
        "id": "abcdefgh1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    },
    {"id": "abcdefgh2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 40}}},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = write_tool_model(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_parser_reads_what_the_template_writes(models, family):
    tok = AutoTokenizer.from_pretrained(models(family))
    calls = CALLS[:1] if family == "harmony" else CALLS  # harmony: one call a message
    prompt = tok.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    history = tok.apply_chat_template(
        USER + [{"role": "assistant", "content": "", "tool_calls": calls}], tools=TOOLS, tokenize=False
    )
    same = next((i for i, (a, b) in enumerate(zip(prompt, history)) if a != b), len(prompt))
    written = history[same:]
    for end in (tok.eos_token, "<|im_end|>", "<｜end▁of▁sentence｜>"):
        written = written.split(end)[0]  # the end of the turn: never in a generation's text
    fmt = format_for(tok, TOOLS)
    parsed = fmt.parse(written, final=True)
    assert [(n, a) for n, a in parsed.calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ], written
    assert parsed.content.strip() in ("", "<think>\n\n</think>", "<think></think>", "</think>")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_call_parses_and_validates(models, family):
    with moestream.load(str(models(family)), cache="1MiB") as engine:
        for seed in range(6):
            choice = "required" if seed % 2 else {"name": "add" if seed % 4 else "get_weather"}
            out = engine.generate(
                messages=USER,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=300,
                temperature=1.0,
                seed=seed,
            )
            assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1, (seed, out.text)
            call = out.tool_calls[0]
            if isinstance(choice, dict):
                assert call.name == choice["name"]
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.id and (
                len(call.id) == 9 if family.startswith("mistral") else call.id.startswith("call_")
            )
        # streamed: the same call, once, and content pieces that join to the content
        forced = dict(tools=TOOLS, tool_choice="required", max_tokens=300, seed=1, temperature=1.0)
        pieces = [(g.piece, g) for g in engine.stream(messages=USER, parallel_tool_calls=False, **forced)]
        last = pieces[-1][1]  # one Generation grows: its piece is read as it is yielded
        whole = engine.generate(messages=USER, parallel_tool_calls=False, **forced)
        assert "".join(p for p, _ in pieces) == last.text == whole.text
        assert [(c.name, c.arguments) for c in last.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]


@pytest.mark.parametrize("family", ["qwen3", "harmony", "mistral_args"])
def test_auto_and_parallel_calls(models, family):
    """auto lets the (random) model write anything: the answer is content, calls or both, and the
    content streams as it is written; parallel forced calls are all read."""
    with moestream.load(str(models(family)), cache="1MiB") as engine:
        for seed in range(3):
            pieces = [
                (g.piece, g)
                for g in engine.stream(messages=USER, tools=TOOLS, max_tokens=40, seed=seed, temperature=1.0)
            ]  # one Generation grows: its piece is read as it is yielded
            last = pieces[-1][1]
            assert "".join(p for p, _ in pieces) == last.text
            assert last.finish_reason in ("length", "stop", "tool_calls")
        if family != "harmony":  # one call a message there
            out = engine.generate(
                messages=USER, tools=[ADD], tool_choice="required", max_tokens=120, seed=0, temperature=1.0
            )
            assert out.tool_calls and all(c.name == "add" for c in out.tool_calls)


def test_streamed_parse_only_grows():
    """Fed a growing text character by character, content and calls only ever grow, to the final parse."""
    texts = {
        "qwen3": 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
        "qwen3_xml": "Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "glm45": "<think></think>\nOk<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
        "<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        "harmony": "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}',
        "harmony_final": "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hi there<|return|>",
        "deepseek_v3": 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "deepseek_fenced": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
        '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "mistral": 'x [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "mistral_args": 'y[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ'
        '[ARGS]{"city": "Rome", "days": 1}',
    }
    from moestream.engine.tools import DeepSeekV3, Glm45, Harmony, Mistral, Qwen3, Qwen3Xml

    formats = {
        "qwen3": Qwen3(TOOLS, {}),
        "qwen3_xml": Qwen3Xml(TOOLS, {}),
        "glm45": Glm45(TOOLS, {}),
        "harmony": Harmony(TOOLS, {}),
        "harmony_final": Harmony(TOOLS, {}),
        "deepseek_v3": DeepSeekV3(TOOLS, {}),
        "deepseek_fenced": DeepSeekV3(TOOLS, {}, fenced=True),
        "mistral": Mistral(TOOLS, {}),
        "mistral_args": Mistral(TOOLS, {}, args_token=True),
    }
    expected_content = {
        "qwen3": "Sure.",
        "qwen3_xml": "Let me look.",
        "glm45": "<think></think>\nOk",
        "harmony_final": "Hi there",
        "deepseek_v3": "Checking.",
        "mistral": "x",
        "mistral_args": "y",
    }
    for name, text in texts.items():
        session = ToolSession(formats[name], "auto", True, set())
        pieces, calls = [], []
        for n in range(1, len(text) + 1):
            piece, new = session.update(text[:n], final=False)
            pieces.append(piece)
            calls += new
        piece, new = session.update(text, final=True)
        pieces.append(piece)
        calls += new
        assert "".join(pieces) == session.content == expected_content.get(name, ""), name
        final = formats[name].parse(text, final=True)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == final.calls, name
        assert final.calls or name == "harmony_final"


def test_refusals_name_the_field(models, tiny_dir):
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB") as engine:
        with pytest.raises(MoestreamError, match="does not render tools") as err:
            engine.generate(messages=USER, tools=TOOLS)
        assert err.value.param == "tools"
    with moestream.load(str(models("qwen3")), cache="1MiB") as engine:
        cases = [
            ({"tool_choice": {"name": "nope"}}, "tool_choice", "names 'nope', which is not in tools"),
            ({"tools": None, "tool_choice": "required"}, "tool_choice", "there are no tools"),
            ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
            ({"tools": [{"type": "function"}]}, "tools", "each tool must be"),
            (
                {"tool_choice": "required", "response_format": {"type": "json_object"}},
                "tool_choice",
                "give one",
            ),
        ]
        for kwargs, param, match in cases:
            with pytest.raises(MoestreamError, match=match) as err:
                engine.generate(messages=USER, **{"tools": TOOLS, **kwargs}, max_tokens=4)
            assert err.value.param == param
        with pytest.raises(MoestreamError, match="tools are rendered by the chat template"):
            engine.generate("plain text", tools=TOOLS, max_tokens=2)
        none = engine.generate(messages=USER, tools=TOOLS, tool_choice="none", max_tokens=3, ignore_eos=True)
        plain = engine.generate(messages=USER, max_tokens=3, ignore_eos=True)
        assert none.tokens == plain.tokens and none.prompt_tokens == plain.prompt_tokens  # no tools rendered


def test_chat_cli_tools_and_generate_json_schema(models, tmp_path, monkeypatch, capsys):
    """`moestream chat --tools`: a forced call is shown, /tool answers it and the model goes on;
    `moestream generate --json-schema --json --logprobs` writes valid JSON and each token's logprob."""
    import io
    import sys

    from moestream.cli import main

    model = models("qwen3")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([ADD]))
    monkeypatch.setattr(sys, "stdin", io.StringIO('/tool too early\n2 and 40?\n/tool {"sum": 42}\n'))
    common = ["--cache", "1MiB", "-t", "1", "--temperature", "1", "--seed", "1"]
    assert main(["chat", str(model), "--tools", str(tools), "--tool-choice", "add", "-n", "60", *common]) == 0
    out, err = capsys.readouterr()
    call = re.search(r"\[tool call add (\{.*\})\]", out)
    assert call and jsonschema.validate(json.loads(call[1]), SCHEMAS["add"]) is None, out
    assert "[no tool call waits for a result]" in err and "error" not in err
    assert out.count("[tool call add") == 2  # the second turn (after the result) is forced too

    schema = json.dumps(SCHEMAS["get_weather"])
    assert (
        main(
            [
                "generate",
                str(model),
                "-p",
                "x",
                "-n",
                "200",
                "-j",
                schema,
                "--json",
                "--logprobs",
                "2",
                *common,
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(result["text"]), SCHEMAS["get_weather"])
    assert len(result["logprobs"]) == len(result["tokens"]) and all(
        len(e["top"]) == 2 for e in result["logprobs"]
    )
    for bad, message in [
        (["-j", "{nope"], "--json-schema is not JSON"),
        (["-j", '{"type": "wat"}'], "cannot be compiled"),
        (["--logprobs", "2"], "add --json"),
    ]:
        assert main(["generate", str(model), "-p", "x", *bad, *common]) != 0
        assert message in capsys.readouterr().err
    assert main(["chat", str(model), "--tool-choice", "required", *common]) != 0
    assert "--tool-choice needs --tools" in capsys.readouterr().err
