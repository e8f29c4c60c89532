"""Response bodies and SSE chunks of /v1/completions and /v1/chat/completions, in OpenAI's shapes.

Every non-streamed response, and the last chunk of a stream (the one with `finish_reason`), also carry
`usage`, llama-server's `timings` and a `moe` object (see timings.py). With
`stream_options.include_usage` they move to one more chunk with `choices: []`, as OpenAI, vLLM and
llama-server send it, and every other chunk has `"usage": null`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from moestream.engine.requests import Generation
from moestream.server import timings


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _extras(gen: Generation) -> dict[str, Any]:
    return {"usage": timings.usage(gen), "timings": timings.timings(gen), "moe": timings.moe(gen)}


class Shape:
    """Builds the objects of one request; `chat` selects chat.completion(.chunk) over text_completion."""

    def __init__(self, model: str, chat: bool, include_usage: bool = False) -> None:
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            chunk = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
            chunk = self._envelope("text_completion", [choice])
        return {**chunk, "usage": None} if self.include_usage else chunk

    def opening(self) -> str | None:
        """The chunk sent before any token (chat streams open with the assistant role)."""
        return sse(self._chunk({"role": "assistant", "content": ""}, None)) if self.chat else None

    def delta(self, text: str) -> str:
        """A chunk with newly generated text."""
        return sse(self._chunk({"content": text} if self.chat else text, None))

    def last(self, text: str, gen: Generation) -> str:
        """The closing chunk(s): the held-back text and finish_reason, with usage, timings and moe on it
        or, with include_usage, on a chunk of their own."""
        delta: dict[str, Any] | str = ({"content": text} if text else {}) if self.chat else text
        if not self.include_usage:
            return sse({**self._chunk(delta, gen.finish_reason), **_extras(gen)})
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._chunk(delta, gen.finish_reason)) + sse({**self._envelope(obj, []), **_extras(gen)})

    def whole(self, gen: Generation) -> dict[str, Any]:
        """The non-streamed response."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": gen.text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
            return {**self._envelope("chat.completion", [choice]), **_extras(gen)}
        choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
        return {**self._envelope("text_completion", [choice]), **_extras(gen)}
