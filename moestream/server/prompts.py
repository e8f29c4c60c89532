"""Turning requests into token ids, and checking them against the context, off the event loop.

The worker thread decodes with the engine's tokenizer after every token. A Hugging Face fast tokenizer
may not be used from two threads at once, so the server loads its own copies from the checkpoint, one
per tokenizing thread: one for short prompts and one for long ones, so that a prompt of megabytes never
holds up a short request. A long text is first counted in pieces and refused as soon as the count
passes the context, so that the tokens of megabytes of text (an Encoding of ~100 bytes per token) are
never all held; only a text that fits is tokenized whole. Long prompts being tokenized count against
the queue's room. Memory freed by a long one is handed back to the system (malloc_trim).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from moestream.engine.chat import TemplateKwargsError, render_chat, render_chat_text
from moestream.engine.engine import Engine
from moestream.engine.tools import ToolSession, tool_session
from moestream.errors import MoestreamError
from moestream.server.errors import APIError

LONG = 64 << 10  # characters: a text longer than this is tokenized on the long lane, counted first
PIECE = 16 << 10  # characters counted at once; cut before a space, where tokenizers split anyway
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


class Prompts:
    """Encodes completion prompts and renders chat messages the way `Engine.encode` does."""

    def __init__(self, engine: Engine, room: Any = lambda: 1 << 30) -> None:
        self.context = engine.ctx_size
        self.room = room  # how many more requests the queue takes now
        self.vocab = int(engine.model.get_input_embeddings().num_embeddings)
        self.tokenizer: Any = None
        self._long_tokenizer: Any = None
        if engine.tokenizer is not None:
            self.tokenizer = _own_copy(engine)
            self._long_tokenizer = _own_copy(engine)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-tokenizer")
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-tokenizer-long")
        self.long_in_flight = 0  # long prompts being tokenized or waiting to be (they count as queued)

    async def _on_lane(self, size: int, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if size <= LONG:
            return await loop.run_in_executor(self._pool, fn, self.tokenizer, *args)
        if self.long_in_flight >= self.room():
            raise APIError(
                503,
                f"the server is busy ({self.long_in_flight} long prompts are being tokenized and the "
                "queue has no room for more); retry later",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        self.long_in_flight += 1
        try:
            return await loop.run_in_executor(self._long, _trimmed, fn, self._long_tokenizer, *args)
        finally:
            self.long_in_flight -= 1

    async def completion(self, prompt: str | list[int]) -> list[int]:
        """Ids of a completion prompt; token ids are checked against the vocabulary."""
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"token id {bad} in 'prompt' is outside the vocabulary (0..{self.vocab - 1})",
                    param="prompt",
                    code="invalid_value",
                )
            return list(prompt)
        self._need_tokenizer("prompt")
        return await self._on_lane(len(prompt), self._encode, prompt)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Ids of the messages (and tools) rendered by the tokenizer's chat template, with the assistant
        turn opened; `template_kwargs` are the request's chat_template_kwargs."""
        self._need_tokenizer("messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "this model's tokenizer has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        size = _content_size(messages) + (len(json.dumps(tools)) if tools else 0)
        return await self._on_lane(size, self._render, messages, template_kwargs, tools)

    async def tool_session(
        self, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
    ) -> ToolSession | None:
        """The request's tool calls checked against the chat template (`engine.tools.tool_session`), on
        the tokenizing thread that owns this tokenizer copy.

        Raises:
            GrammarError: a tool or tool_choice that cannot be used (`param` names which).
        """
        if not tools and choice in ("none", "auto"):
            return None
        return await self._on_lane(0, _tool_session, tools, choice, parallel)

    def check_bias(self, logit_bias: dict[str, float]) -> None:
        """logit_bias keys must be token ids of the vocabulary."""
        bad = next((k for k in logit_bias if int(k) >= self.vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"token id {bad} in 'logit_bias' is outside the vocabulary (0..{self.vocab - 1})",
                param="logit_bias",
                code="invalid_value",
            )

    def _encode(self, tok: Any, text: str) -> list[int]:
        # as Engine.encode: no special tokens added; an empty prompt becomes BOS (or EOS)
        try:
            self._count_within_context(tok, text, "prompt")
            ids = list(tok.encode(text, add_special_tokens=False))
        except APIError:
            raise
        except Exception as exc:  # the request's text, not the server, is at fault
            raise APIError(
                400, f"the prompt could not be tokenized: {exc}", param="prompt", code="invalid_value"
            ) from None
        return ids or [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]

    def _render(
        self,
        tok: Any,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        try:
            if _content_size(messages) > LONG:
                text = render_chat_text(tok, messages, template_kwargs, tools)
                self._count_within_context(tok, text, "messages")
            return render_chat(tok, messages, template_kwargs, tools)
        except MoestreamError as exc:
            param = "chat_template_kwargs" if isinstance(exc, TemplateKwargsError) else "messages"
            raise APIError(400, str(exc), param=param, code="invalid_value") from None

    def _count_within_context(self, tok: Any, text: str, param: str) -> None:
        """Count a long text's tokens piece by piece; refuse it once the count passes the context (each
        cut may add a token or two, hence the allowance), before the rest is tokenized."""
        if len(text) <= LONG:
            return
        count = 0
        for cuts, piece in enumerate(_pieces(text)):
            count += len(tok.encode(piece, add_special_tokens=False))
            if count - 2 * cuts > self.context:
                raise APIError(
                    400,
                    f"the prompt has more than {self.context} tokens (counted over its first "
                    f"{_chars(cuts + 1)}), more than the context of {self.context} leaves room for "
                    f"(at most {self.context - 1})",
                    param=param,
                    code="context_length_exceeded",
                )

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(
                400,
                "this model has no tokenizer; send 'prompt' as a list of token ids to /v1/completions",
                param=param,
                code="no_tokenizer",
            )

    def budget(self, prompt_n: int, requested: int | None, default: int | None, param: str = "prompt") -> int:
        """max_tokens for a prompt of `prompt_n` tokens: the request's, or `default`, or all the context left.

        Raises:
            APIError: max_tokens < 1, or the prompt or prompt + max_tokens does not fit in the context.
        """
        if requested is not None and requested < 1:
            raise APIError(
                400,
                f"max_tokens must be at least 1, got {requested}",
                param="max_tokens",
                code="invalid_value",
            )
        room = self.context - prompt_n
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {prompt_n} tokens, more than the context of {self.context} "
                f"leaves room for (at most {self.context - 1})",
                param=param,
                code="context_length_exceeded",
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(
                400,
                f"max_tokens {requested} plus the prompt's {prompt_n} tokens exceeds the context "
                f"of {self.context} tokens (at most {room} here; the server's --ctx-size)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._long.shutdown(wait=False)


def _tool_session(tok: Any, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool) -> Any:
    return tool_session(tok, tools, choice, parallel)


def _content_size(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' contents (what decides a chat request's lane)."""
    return sum(len(str(m.get("content") or "")) for m in messages)


def _own_copy(engine: Engine) -> Any:
    """A tokenizer of the lane's own, from the checkpoint (a fast tokenizer is not thread-safe)."""
    tok = engine.source.tokenizer()
    tok.chat_template = engine.tokenizer.chat_template  # --chat-template replaces it
    return tok


def _pieces(text: str):
    """Consecutive pieces of about PIECE characters, each cut just before a space where there is one."""
    start = 0
    while start < len(text):
        end = min(start + PIECE, len(text))
        if end < len(text):
            space = text.rfind(" ", start + PIECE // 2, end)
            end = space if space > start else end
        yield text[start:end]
        start = end


def _chars(pieces: int) -> str:
    return f"~{pieces * PIECE // 1024}K characters"


def _trimmed(fn: Any, *args: Any) -> Any:
    """Run `fn`, then give the memory it freed back to the system (glibc keeps it in its arenas)."""
    try:
        return fn(*args)
    finally:
        try:
            _libc.malloc_trim(0)
        except AttributeError:  # not glibc
            pass
