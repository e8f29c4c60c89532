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

Entries = list[dict[str, Any]]  # log-probabilities (server/worker.py) or tool calls, in OpenAI's shape


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _extras(gen: Generation) -> dict[str, Any]:
    return {"usage": timings.usage(gen), "timings": timings.timings(gen), "moe": timings.moe(gen)}


class Shape:
    """Builds the objects of one request; `chat` selects chat.completion(.chunk) over text_completion,
    `logprobs` adds each token's log-probabilities (chat's `logprobs.content`, or the completions API's
    tokens / token_logprobs / top_logprobs / text_offset)."""

    def __init__(self, model: str, chat: bool, include_usage: bool = False, logprobs: bool = False) -> None:
        self.model, self.chat, self.include_usage, self.logprobs = model, chat, include_usage, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset: characters of the tokens reported so far
        self._calls = 0  # tool calls streamed so far (their delta index)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            content = [
                {
                    **_token(e["token"], e["logprob"]),
                    "top_logprobs": [_token(t, lp) for t, lp in e["top"]],
                }
                for e in entries
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_by_text(e["top"]) for e in entries],
            "text_offset": offsets,
        }

    def _chunk(
        self,
        delta: dict[str, Any] | str,
        finish_reason: str | None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        lp = self._logprobs(logprobs or []) if logprobs else None
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            chunk = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish_reason}
            chunk = self._envelope("text_completion", [choice])
        return {**chunk, "usage": None} if self.include_usage else chunk

    def _delta(self, text: str, calls: list[dict[str, Any]]) -> dict[str, Any] | str:
        if not self.chat:
            return text
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [{"index": self._calls + i, **call} for i, call in enumerate(calls)]
            self._calls += len(calls)
        return delta

    def opening(self) -> str | None:
        """The chunk sent before any token (chat streams open with the assistant role)."""
        return sse(self._chunk({"role": "assistant", "content": ""}, None)) if self.chat else None

    def delta(
        self,
        text: str,
        logprobs: list[dict[str, Any]] | None = None,
        calls: list[dict[str, Any]] | None = None,
    ) -> str | None:
        """A chunk with newly generated text (its tokens' log-probabilities, the calls completed); None
        when there is nothing to send."""
        if not (text or logprobs or calls):
            return None
        return sse(self._chunk(self._delta(text, calls or []), None, logprobs))

    def last(
        self,
        text: str,
        gen: Generation,
        logprobs: list[dict[str, Any]] | None = None,
        calls: list[dict[str, Any]] | None = None,
    ) -> str:
        """The closing chunk(s): the held-back text, log-probabilities and calls, and finish_reason, with
        usage, timings and moe on it or, with include_usage, on a chunk of their own."""
        delta = self._delta(text, calls or [])
        chunk = self._chunk(delta, gen.finish_reason, logprobs)
        if not self.include_usage:
            return sse({**chunk, **_extras(gen)})
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(chunk) + sse({**self._envelope(obj, []), **_extras(gen)})

    def whole(
        self,
        gen: Generation,
        logprobs: list[dict[str, Any]] | None = None,
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The non-streamed response."""
        lp = self._logprobs(logprobs or [])
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": gen.text}
            if calls:
                message["content"] = gen.text or None
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": gen.finish_reason}
            return {**self._envelope("chat.completion", [choice]), **_extras(gen)}
        choice = {"index": 0, "text": gen.text, "logprobs": lp, "finish_reason": gen.finish_reason}
        return {**self._envelope("text_completion", [choice]), **_extras(gen)}


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """The legacy API's {token text: logprob}: two tokens of one text (pieces of a character) keep the
    likelier one's."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
