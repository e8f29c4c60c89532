"""Tool calls, JSON-schema output and log-probabilities through `moestream serve` and the real `openai`
client: a two-turn tool loop (call -> result -> answer) on a tiny model whose chat template has tools
(Qwen3's, and gpt-oss's harmony with its special tokens), calls streamed as `delta.tool_calls`,
`response_format` and llama-server's `json_schema` valid on every seed, logprobs streamed and not."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
from test_server_harness import LiveServer, shared_server
from test_tool_calls import ADD, SCHEMAS, TOOLS, USER
from tool_models import write_tool_model
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "maxItems": 2},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started: dict[str, LiveServer] = {}

    def get(family: str) -> LiveServer:
        if family not in started:
            path = write_tool_model(family, tmp_path_factory.mktemp(family) / family)
            started[family] = LiveServer(path, ["--cache", "1MiB", "--threads", "1"])
        return started[family]

    yield get
    for server in started.values():
        server.stop()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def _streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """Content, tool calls (assembled from their deltas, as the openai package documents) and
    finish_reason of a chat stream."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("family", ["qwen3", "harmony"])
def test_two_turn_tool_loop(servers, family):
    server = servers(family)
    client = _client(server)
    ask = dict(model=server.model, tools=TOOLS, temperature=1.0, seed=3, max_tokens=300)
    # turn 1: the model must call a tool (forced: random weights would rarely choose to)
    first = client.chat.completions.create(messages=USER, tool_choice="required", **ask)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # the same request streamed: the same call, as delta.tool_calls chunks
    content, calls, finish = _streamed_calls(
        client.chat.completions.create(messages=USER, tool_choice="required", stream=True, **ask)
    )
    assert finish == "tool_calls" and content == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    # turn 2: the tool's result goes back through the template, and the model answers
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}
    history = [*USER, choice.message.model_dump(exclude_none=True), result]
    second = client.chat.completions.create(
        messages=history, **{**ask, "max_tokens": 8}, extra_body={"ignore_eos": True}, tool_choice="none"
    )
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
    tok = AutoTokenizer.from_pretrained(server.path)
    expected = tok.apply_chat_template(_template_history(history), add_generation_prompt=True, tokenize=False)
    assert "temp_c" in expected and "21" in expected
    assert second.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
    auto = client.chat.completions.create(messages=history, **{**ask, "max_tokens": 30})
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _template_history(history: list[dict]) -> list[dict]:
    """The conversation as the server renders it: arguments as objects, no tools (tool_choice none)."""
    out = []
    for m in copy.deepcopy(history):
        m = {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
        m["content"] = m.get("content") or ""
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        out.append(m)
    return out


def test_named_function_and_parallel_calls(servers):
    server = servers("qwen3")
    client = _client(server)
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(4):
        out = client.chat.completions.create(
            model=server.model,
            messages=USER,
            tools=TOOLS,
            tool_choice=named,
            seed=seed,
            temperature=1.0,
            max_tokens=300,
            parallel_tool_calls=False,
        )
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "add" and calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["add"])
    out = client.chat.completions.create(
        model=server.model,
        messages=USER,
        tools=[ADD],
        tool_choice="required",
        seed=0,
        temperature=1.0,
        max_tokens=150,
    )
    assert all(c.function.name == "add" for c in out.choices[0].message.tool_calls)


def test_tool_requests_refused_by_name(servers):
    server = servers("qwen3")
    client = _client(server)
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=server.model, messages=USER, max_tokens=4, **kwargs)
        assert err.value.param == param, err.value
    assert client.chat.completions.create(model=server.model, messages=USER, max_tokens=2).choices


@pytest.fixture(scope="module")
def server(tiny_dir):
    return shared_server(tiny_dir("qwen3_moe"))


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_always_validates(server, stream):
    client = server.client()
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for seed in range(8):
        ask = dict(model=server.model, temperature=1.0, seed=seed, max_tokens=200)
        if stream:
            chunks = client.chat.completions.create(messages=USER, response_format=FORMAT, stream=True, **ask)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            out = client.chat.completions.create(messages=USER, response_format=FORMAT, **ask)
            assert out.choices[0].finish_reason == "stop"
            text = out.choices[0].message.content
        validator.validate(json.loads(text))
        # completions, and llama-server's json_schema field
        done = client.completions.create(prompt="Weather:", extra_body={"json_schema": SCHEMA}, **ask)
        validator.validate(json.loads(done.choices[0].text))
    # any object: free strings and nesting, which random weights may not close within max_tokens
    for seed in range(4):
        obj = client.chat.completions.create(
            model=server.model,
            messages=USER,
            response_format={"type": "json_object"},
            max_tokens=100,
            temperature=1.0,
            seed=seed,
        ).choices[0]
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.message.content), dict)
        else:
            assert obj.finish_reason == "length" and obj.message.content.startswith("{")


def test_bad_schema_is_a_400_naming_the_problem(server):
    client = server.client()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=USER, response_format=bad, max_tokens=4)
    assert err.value.param == "response_format" and "Unimplemented keys" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="x", max_tokens=4, extra_body={"json_schema": 5})
    assert err.value.param == "json_schema"


def test_logprobs_streamed_and_not(server):
    client = server.client()
    ask = dict(
        model=server.model,
        messages=USER,
        max_tokens=6,
        temperature=0.8,
        seed=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**ask).choices[0]
    entries = whole.logprobs.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in entries)
    assert all(e.logprob <= 0 and e.bytes == list(e.token.encode()) for e in entries)
    streamed = [
        e
        for c in client.chat.completions.create(stream=True, **ask)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # the same tokens and values (the second request reuses the first's KV cache: logits equal to ~1e-7)
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, entries))
    done = client.completions.create(
        model=server.model,
        prompt="Hello",
        max_tokens=5,
        logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]
    lp = done.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == done.text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    greedy_top = [max(t.values()) for t in lp.top_logprobs]
    assert all(abs(a - b) < 1e-6 for a, b in zip(lp.token_logprobs, greedy_top))  # greedy took the best
