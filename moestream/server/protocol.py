"""Request bodies of the OpenAI-compatible endpoints, validated strictly (a string is never an integer).

Fields that OpenAI clients send routinely and that change nothing here (user, presence_penalty, ...) are
accepted and ignored; fields whose meaning we cannot honour (n > 1, logprobs, echo, tools) are refused
with a message, so a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# the range torch.Generator.manual_seed accepts
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_STOP_STRINGS = 16


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    n: int = 1
    ignore_eos: bool = False  # llama-server's extension: fixed-length runs for benchmarks
    logprobs: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            if len(value) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(value)}")
            return value
        raise ValueError("must be a string or a list of strings")

    def refusal(self) -> tuple[str, str] | None:
        """(param, message) when the request asks for something this server does not do."""
        if self.n != 1:
            return "n", f"n must be 1: this server generates one choice per request (got n={self.n})"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported by this server"
        return None

    def limit(self) -> int | None:
        """The requested number of tokens, or None when the request leaves it to the server."""
        return self.max_tokens


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one prompt is one prompt
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        raise ValueError("must be a string or a non-empty list of token ids")

    def refusal(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by this server"
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported by this server"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1: this server generates one choice per request"
        return super().refusal()


class ChatMessage(BaseModel):
    """One message; content is text or a list of text parts."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for part in value:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise ValueError('only text content parts ({"type": "text", "text": ...}) are supported')
                parts.append(part["text"])
            return "".join(parts)
        raise ValueError("must be a string or a list of text parts")


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: messages rendered through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    tools: list[Any] | None = None

    def refusal(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported by this server"
        return super().refusal()

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template expects them."""
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]
