"""A request's prompt as token ids the model takes, and the context a request may use (--ctx-size, at
most the model's trained context)."""

from __future__ import annotations

import numbers
from typing import Any

from moestream.errors import MoestreamError

DEFAULT_CONTEXT = 8192  # --ctx-size when not given: the smaller of this and the model's maximum


def context_size(requested: int | None, model: int | None) -> int:
    """--ctx-size, at most the model's trained context (default: the smaller of it and 8192)."""
    if requested is not None and model is not None and requested > model:
        raise MoestreamError(
            f"--ctx-size {requested} is beyond the model's trained context of {model} tokens, where its "
            f"output would look like text but not be the model's"
        )
    return requested or min(model or DEFAULT_CONTEXT, DEFAULT_CONTEXT)


def prompt_ids(
    engine: Any,
    prompt: str | list[int] | None,
    messages: list[dict[str, Any]] | None,
    chat: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """`Engine.stream`'s prompt, text or token ids, or its chat messages (and tools), as token ids the
    model takes.

    Raises:
        MoestreamError: neither or both given, template variables for no template, chat=True with
            token ids, an empty prompt, or an id that is not a token of the model.
    """
    if (prompt is None) == (messages is None):
        raise MoestreamError("give either a prompt or messages")
    templated = messages is not None or (chat and isinstance(prompt, str))
    if template_kwargs and not templated:
        raise MoestreamError(
            "chat_template_kwargs set chat template variables, and this prompt goes through no template "
            "(give messages, or a text prompt with chat=True)"
        )
    if chat and prompt is not None and not isinstance(prompt, str):
        raise MoestreamError(
            "chat=True renders a text prompt through the chat template; token ids are used as given"
        )
    if tools and isinstance(prompt, str) and not templated:
        raise MoestreamError(
            "tools are rendered by the chat template, and this text prompt goes through none (give "
            "messages, or chat=True; token ids already rendered with the tools are taken as they are)"
        )
    if messages is None and chat:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        ids = engine.encode_messages(messages, template_kwargs, tools)
    else:
        ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise MoestreamError("the prompt is empty")
    check_ids(ids, engine.model.get_input_embeddings().num_embeddings)
    return ids


def check_ids(ids: list[Any], vocab: int) -> None:
    """Token ids a caller passed must index the embedding (else an IndexError from deep in torch)."""
    bad = next(
        (t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab),
        None,
    )
    if bad is not None:
        raise MoestreamError(f"token id {bad!r} in the prompt is not a token of this model (0..{vocab - 1})")


def check_context(prompt_n: int, max_tokens: int, ctx: int, model_context: int | None) -> None:
    """Refuse a prompt and max_tokens that do not fit the context (--ctx-size, at most the model's:
    positions past the trained context give text that looks like output but is not)."""
    if ctx == model_context:
        which = f"the model's context of {ctx} tokens"
    else:
        which = f"the context of {ctx} tokens (--ctx-size)"
    if prompt_n >= ctx:
        raise MoestreamError(
            f"the prompt has {prompt_n} tokens, more than {which} leaves room for (at most {ctx - 1})"
        )
    if prompt_n + max_tokens > ctx:
        raise MoestreamError(
            f"max tokens {max_tokens} plus the prompt's {prompt_n} tokens exceeds {which} "
            f"(at most {ctx - prompt_n} here)"
        )
