"""What every tool-call format shares: the calls, the parse of a growing text, the Lark pieces of a
forced call.

A format's `parse(text, final)` reads everything the model wrote so far and returns the content (the
text outside calls) and the calls complete so far. Both only grow as the text grows (a tail that may
still turn into a call's start is held back), so the stream's pieces join to exactly the final content.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from moestream.engine.grammar import lark_json


@dataclass
class ToolCall:
    """One call: its id (sent back with the tool's result), the function's name and its arguments as
    JSON text (OpenAI's `function.arguments`)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class Parsed:
    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class ToolFormat:
    """One template family's way of writing calls. `markers` are the texts that must survive decoding
    (special tokens are then kept); `tools` the request's tools (some formats need the parameters'
    types to read an argument)."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]], vocab: dict[str, int]) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools}
        self.vocab = vocab  # token text -> id, for the forced call's grammar

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def grammar(self, names: list[str], parallel: bool) -> str:
        """A Lark grammar (llguidance's) of one call (or, with `parallel`, one or more) to one of `names`."""
        raise NotImplementedError

    def call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    # --- helpers ------------------------------------------------------------------------------

    def lit(self, text: str) -> str:
        """`text` in a grammar: the one token that spells it where the vocabulary has one (llguidance
        sees every added token as special, and a forced call should use the token the model learned),
        else the literal characters."""
        token = self.vocab.get(text)
        if token is not None:
            return f"<[{token}]>"
        return json.dumps(text, ensure_ascii=False)

    def parameters(self, name: str) -> dict[str, Any]:
        schema = self.tools.get(name, {}).get("parameters") or {"type": "object", "properties": {}}
        return schema

    def param_is_string(self, name: str, key: str) -> bool:
        prop = (self.parameters(name).get("properties") or {}).get(key) or {}
        kind = prop.get("type")
        return kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1)

    def value(self, name: str, key: str, raw: str) -> Any:
        """An argument written as plain text (the XML formats): a string parameter's text as is, any
        other parsed as JSON where it parses."""
        if self.param_is_string(name, key):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def value_rule(self, name: str, key: str) -> str:
        """A plain-text argument in a grammar: a string parameter as its enum or as text without '<'
        (of its minLength to maxLength characters), any other as JSON of its schema."""
        prop = (self.parameters(name).get("properties") or {}).get(key) or {}
        if not self.param_is_string(name, key):
            return lark_json(prop)
        if isinstance(prop.get("enum"), list) and all(isinstance(v, str) for v in prop["enum"]):
            return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in prop["enum"]) + ")"
        low, high = int(prop.get("minLength", 0)), prop.get("maxLength")
        if high is None:
            return r"/[^<]*/" if low == 0 else f"/[^<]{{{low},}}/"
        return f"/[^<]{{{low},{int(high)}}}/"

    def json_call(self, name: str, params_key: str = "arguments") -> str:
        return lark_json(
            {
                "type": "object",
                "properties": {"name": {"const": name}, params_key: self.parameters(name)},
                "required": ["name", params_key],
                "additionalProperties": False,
            }
        )


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker (it may still become one)."""
    held = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:n]):
                held = n
                break
    return held


class Segmented(ToolFormat):
    """Calls written between a start marker and an end marker (None: the end of the text, or the next
    start), each body read by `body`; `wrappers` are markers around the calls, dropped from content."""

    start = ""
    end: str | None = None
    wrappers: tuple[str, ...] = ()

    def body(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[tuple[str, dict[str, Any]]] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                cut = 0 if final else held_back(tail, (self.start, *self.wrappers))
                content.append(tail[: len(tail) - cut])
                break
            content.append(text[pos:i])
            begin = i + len(self.start)
            j = text.find(self.end, begin) if self.end else text.find(self.start, begin)
            if j < 0:
                if not final:
                    break  # an open call: held back until it closes
                j = stop = len(text)
            else:
                stop = j + (len(self.end) if self.end else 0)
            parsed = self.body(text[begin:j])
            if parsed is None:  # not a call after all: the model's text, as written
                content.append(text[i:stop])
            else:
                calls.extend(parsed)
            pos = stop
        out = "".join(content)
        for wrapper in self.wrappers:
            out = out.replace(wrapper, "")
        return Parsed(out, calls)


def json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def named_call(obj: Any, params_key: str = "arguments") -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of {"name": ..., "arguments": {...}} (or "parameters"), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(params_key, obj.get("parameters", {}))
    if isinstance(args, str):
        args = json_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None


ALNUM = string.ascii_letters + string.digits
NEWLINE = '"\\n"'  # a newline in a Lark grammar


def start_rule(call: str, parallel: bool, between: str = NEWLINE) -> str:
    """The grammar's start rule: one call, or one or more `between` one another."""
    return f"start: {call} ({between} {call})*\n" if parallel else f"start: {call}\n"
