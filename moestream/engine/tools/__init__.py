"""Tool calls in each template family's own format: which format a chat template writes, and one
request's calls read out of the text as it grows (`ToolSession`).

Tools reach the model through its chat template (transformers' `apply_chat_template(tools=...)`); the
model answers in the format its template taught it, one parser module each here. `tool_choice`
`required` or a named function holds the output to that format by a grammar (engine/grammar.py), so
the call always parses; `auto` lets the model write text or calls; `none` renders no tools.
"""

from __future__ import annotations

from typing import Any

from moestream.engine.grammar import GrammarError, lark_grammar
from moestream.engine.tools.base import Parsed, ToolCall, ToolFormat
from moestream.engine.tools.deepseek_v3 import DeepSeekV3
from moestream.engine.tools.glm45 import Glm45
from moestream.engine.tools.harmony import Harmony
from moestream.engine.tools.mistral import Mistral
from moestream.engine.tools.qwen3 import Qwen3
from moestream.engine.tools.qwen3_xml import Qwen3Xml
from moestream.errors import MoestreamError

__all__ = ["ToolCall", "ToolFormat", "ToolSession", "format_for", "tool_format"]


def tool_format(template: Any) -> tuple[type[ToolFormat], dict[str, Any]] | None:
    """The format class (and its options) a chat template writes calls in; None when no parser here
    reads the template's calls."""
    if not isinstance(template, str):
        return None
    if "<|channel|>" in template and "functions." in template:
        return Harmony, {}
    if "<｜tool▁call▁begin｜>" in template:
        return DeepSeekV3, {"fenced": "```json" in template}
    if "[TOOL_CALLS]" in template:
        return Mistral, {"args_token": "[ARGS]" in template}
    if "<arg_key>" in template:
        return Glm45, {}
    if "<function=" in template and "<parameter=" in template:
        return Qwen3Xml, {}
    if "<tool_call>" in template:
        return Qwen3, {}
    return None


def format_for(tokenizer: Any, tools: list[dict[str, Any]]) -> ToolFormat:
    """The tool-call format of this tokenizer's chat template, set up for `tools`.

    Raises:
        MoestreamError: no tokenizer or template, a template that does not render tools (the model
            would never see them), or one whose calls no parser here reads.
    """
    from moestream.engine.chat import template_variables

    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        raise MoestreamError("this model has no chat template to render tools with")
    if "tools" not in template_variables(template, {"tools"}):
        raise MoestreamError(
            "this model's chat template does not render tools, so the model would never see them; "
            "give one that does with --chat-template FILE"
        )
    found = tool_format(template)
    if found is None:
        raise MoestreamError(
            "this model's chat template writes tool calls in a format moestream does not read (it reads "
            "Qwen3's, Qwen3.5's, gpt-oss's, GLM-4.5's, DeepSeek-V3's and Mistral's)"
        )
    cls, options = found
    return cls(tools, _added_tokens(tokenizer), **options)


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    added = tokenizer.added_tokens_decoder.items()
    return {str(t.content if hasattr(t, "content") else t): i for i, t in added}


class ToolSession:
    """One request's tool calls: the format, the forced grammar (`required` or a named function), and
    the content and calls read from the text so far.

    `update(text, final)` returns the content new since the last call and the calls completed since;
    with `parallel` off a completed call ends the answer (`done`)."""

    def __init__(
        self, fmt: ToolFormat, choice: str | dict[str, Any], parallel: bool, special_tokens: set[str]
    ) -> None:
        self.format, self.parallel = fmt, parallel
        self.content, self.calls = "", []
        # formats whose markers are special tokens need them in the decoded text; the other special
        # tokens are then taken out of the content, as a decode that skips them would
        self.keep_special = any(m in special_tokens for m in fmt.markers)
        self.hidden = (
            sorted(special_tokens - set(fmt.markers), key=len, reverse=True) if self.keep_special else []
        )
        self.grammar: str | None = None
        names = list(fmt.tools)
        if isinstance(choice, dict):
            if choice.get("name") not in fmt.tools:
                name = str(choice.get("name"))[:64]
                raise GrammarError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
            names = [choice["name"]]
        if choice == "required" or isinstance(choice, dict):
            if not names:
                raise GrammarError("tool_choice required needs at least one tool", "tool_choice")
            self.grammar = lark_grammar(fmt.grammar(names, parallel))

    @property
    def done(self) -> bool:
        return not self.parallel and bool(self.calls)

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        parsed: Parsed = self.format.parse(text, final)
        content = parsed.content
        for token in self.hidden:
            content = content.replace(token, "")
        content = content.strip()  # only grows: a tail of whitespace waits for what follows it
        if not content.startswith(self.content):  # cannot happen for a format that holds back right
            content = self.content
        piece, self.content = content[len(self.content) :], content
        new = [ToolCall(self.format.call_id(), n, _json(a)) for n, a in parsed.calls[len(self.calls) :]]
        if not self.parallel:
            new = new[: max(0, 1 - len(self.calls))]
        self.calls.extend(new)
        return piece, new


def _json(args: dict[str, Any]) -> str:
    import json

    return json.dumps(args, ensure_ascii=False)


def tool_session(
    tokenizer: Any, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any], parallel: bool
) -> ToolSession | None:
    """The request's `ToolSession`, or None without tools or with tool_choice "none" (the tools are then
    not rendered: the model cannot call them).

    Raises:
        MoestreamError: a malformed tool or tool_choice, or a template without tools (GrammarError with
            `param` for the request field at fault).
    """
    if choice not in ("none", "auto", "required") and not (isinstance(choice, dict) and "name" in choice):
        raise GrammarError('tool_choice must be "none", "auto", "required" or {"name": ...}', "tool_choice")
    if not tools:
        if choice != "none" and choice != "auto":
            raise GrammarError("tool_choice asks for a call, and there are no tools", "tool_choice")
        return None
    if choice == "none":
        return None
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and function.get("name")):
            raise GrammarError('each tool must be {"type": "function", "function": {"name": ...}}', "tools")
    try:
        fmt = format_for(tokenizer, tools)
    except MoestreamError as exc:
        raise GrammarError(str(exc), "tools") from None
    added = tokenizer.added_tokens_decoder.values()
    special = {str(t.content) for t in added if getattr(t, "special", False)}
    session = ToolSession(fmt, choice, parallel, special)
    if session.grammar is not None:
        from moestream.engine.grammar import check

        check(session.grammar, "tool_choice")
    return session


def with_grammar(params: Any, grammar: str) -> Any:
    """`params` holding the output to `grammar` (a forced tool call).

    Raises:
        GrammarError: params already hold the output to a response_format or grammar.
    """
    import dataclasses

    if params.output_grammar is not None:
        raise GrammarError(
            "response_format and a tool_choice of required or a named function both set the output's "
            "format: give one",
            "tool_choice",
        )
    return dataclasses.replace(params, grammar=grammar)
