"""Turning requests into token ids, and checking them against the context, off the event loop.

The worker thread decodes with the engine's tokenizer after every token. A Hugging Face fast tokenizer
may not be used from two threads at once, so the server loads its own copy from the checkpoint and uses
it on one dedicated thread.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from moestream.engine.chat import TemplateKwargsError, render_chat
from moestream.engine.engine import Engine
from moestream.errors import MoestreamError
from moestream.server.errors import APIError


class Prompts:
    """Encodes completion prompts and renders chat messages the way `Engine.encode` does."""

    def __init__(self, engine: Engine) -> None:
        self.context = engine.ctx_size
        self.vocab = int(engine.model.get_input_embeddings().num_embeddings)
        self.tokenizer: Any = None
        if engine.tokenizer is not None:
            self.tokenizer = engine.source.tokenizer()  # a copy of its own, from the checkpoint
            self.tokenizer.chat_template = engine.tokenizer.chat_template  # --chat-template replaces it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-tokenizer")

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
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, prompt)

    async def chat(self, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> list[int]:
        """Ids of the messages rendered by the tokenizer's chat template, with the assistant turn opened;
        `template_kwargs` are the request's chat_template_kwargs."""
        self._need_tokenizer("messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "this model's tokenizer has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._render, messages, template_kwargs
        )

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

    def _encode(self, text: str) -> list[int]:
        # as Engine.encode: no special tokens added; an empty prompt becomes BOS (or EOS)
        tok = self.tokenizer
        try:
            ids = list(tok.encode(text, add_special_tokens=False))
        except Exception as exc:  # the request's text, not the server, is at fault
            raise APIError(
                400, f"the prompt could not be tokenized: {exc}", param="prompt", code="invalid_value"
            ) from None
        return ids or [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]

    def _render(self, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> list[int]:
        try:
            return render_chat(self.tokenizer, messages, template_kwargs)
        except MoestreamError as exc:
            param = "chat_template_kwargs" if isinstance(exc, TemplateKwargsError) else "messages"
            raise APIError(400, str(exc), param=param, code="invalid_value") from None

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
