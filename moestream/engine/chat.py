"""Chat messages to prompt ids through the tokenizer's chat template (transformers' own rendering)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from moestream.errors import MoestreamError


class TemplateKwargsError(MoestreamError):
    """chat_template_kwargs names a parameter of apply_chat_template itself."""


def reserved_template_kwargs(tokenizer: Any) -> set[str]:
    """Names a request may not set as template variables: `apply_chat_template`'s own parameters
    (tokenize, add_generation_prompt, chat_template, ...) would change how it renders, not what."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    return {name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD} | {"messages"}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Ids of `messages` with the assistant turn opened; `template_kwargs` become template variables
    (e.g. Qwen3's `enable_thinking`); `tools` (OpenAI's shape) are rendered by the template itself.

    Raises:
        MoestreamError: no tokenizer or chat template, a reserved variable name, or the template rejected
            the messages.
    """
    if tokenizer is None:
        raise MoestreamError("this model has no tokenizer, so chat messages cannot be rendered")
    if not getattr(tokenizer, "chat_template", None):
        raise MoestreamError(
            "this model's tokenizer has no chat template (give one with --chat-template FILE)"
        )
    extra = dict(template_kwargs or {})
    clash = sorted(set(extra) & reserved_template_kwargs(tokenizer))
    if clash:
        raise TemplateKwargsError(
            f"chat_template_kwargs may not set {', '.join(clash)}: they are parameters "
            "of the template call, not template variables"
        )
    unread = sorted(set(extra) - template_variables(tokenizer.chat_template, set(extra)))
    if unread:  # a variable the template never reads would change nothing (enable_thinking on a non-Qwen3)
        raise TemplateKwargsError(
            f"chat_template_kwargs {', '.join(unread)}: this model's chat template reads no such "
            "variable, so it would change nothing"
        )
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, **extra
        )
    except Exception as exc:  # templates raise on message orders they do not accept (jinja exceptions)
        raise MoestreamError(f"the chat template rejected the messages: {exc}") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def template_variables(template: Any, default: set[str]) -> set[str]:
    """The variables a Jinja chat template reads (`default` where that cannot be told: a template that
    does not parse, here or in transformers, or several named templates)."""
    if not isinstance(template, str):
        return default
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateError:
        return default
    return meta.find_undeclared_variables(parsed)


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text `render_chat` tokenizes (what the template renders), e.g. to count a long one first."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **dict(template_kwargs or {}),
        )
    except Exception as exc:
        raise MoestreamError(f"the chat template rejected the messages: {exc}") from None


def read_template(path: str | Path) -> str:
    """A chat template file's text (Jinja), for --chat-template."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MoestreamError(
            f"cannot read the chat template {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not text.strip():
        raise MoestreamError(f"the chat template {path} is empty")
    return text
