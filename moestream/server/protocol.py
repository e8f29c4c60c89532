"""Request bodies of the OpenAI-compatible endpoints, validated strictly (a string is never an integer).

`null` for an optional field means its default, as the openai package and its wrappers send it. Fields
that change nothing here (user, metadata, store, ...: `IGNORED`) are accepted and ignored; fields whose
meaning we cannot honour (n > 1, logprobs, tools, response_format, ...) and fields this server does not
know (another server's sampling knobs: typical_p, mirostat, ...) are refused with a message naming the
field, so a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moestream.engine.sampling import SamplingParams

# the range torch.Generator.manual_seed accepts
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_STOP_STRINGS = 16
# OpenAI's defaults, used where neither the request nor the model's generation_config.json says
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# fields of OpenAI's API that ask for something this server does not do: refused when set to anything
# but their "off" values
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
    "functions": (),
    "function_call": ("none",),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "modalities": (["text"],),
    "tool_choice": ("none", "auto"),
    "tools": ([],),
}

# fields of OpenAI's API that change nothing a server computes (bookkeeping, and parallel_tool_calls: no
# tools run here), and llama.cpp's name of a field we have: accepted
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "repeat_penalty"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False  # a last chunk with `choices: []` and the usage


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    # None: the model's generation_config.json default, else OpenAI's (OPENAI_DEFAULTS)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extensions of llama-server and vLLM
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] = Field(default_factory=dict)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # llama-server's extension: fixed-length runs for benchmarks
    cache_prompt: bool = True  # llama-server's: reuse the previous request's KV cache for the common prefix

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        body = {k: v for k, v in body.items() if v is not None}
        if "repeat_penalty" in body and "repetition_penalty" not in body:  # llama.cpp's name
            body["repetition_penalty"] = body["repeat_penalty"]
        return body

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            if len(value) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(value)}")
            return value
        raise ValueError("must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bias in value.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    def refusal(self) -> tuple[str, str] | None:
        """(param, message) when the request asks for something this server does not do."""
        if self.n != 1:
            return "n", f"n must be 1: this server generates one choice per request (got n={self.n})"
        extra = self.model_extra or {}
        for name, off in UNSUPPORTED.items():
            if name in extra and extra[name] not in off:
                return name, f"'{name}' is not supported by this server"
        unknown = next((name for name in extra if name not in UNSUPPORTED and name not in IGNORED), None)
        if unknown is not None:
            return unknown, f"'{unknown[:64]}' is not a field this server knows, so it would change nothing"
        if "repeat_penalty" in extra and extra["repeat_penalty"] != self.repetition_penalty:
            return "repeat_penalty", "repeat_penalty and repetition_penalty are one setting: give one value"
        if self.stream_options is not None and self.stream_options.include_usage and not self.stream:
            return (
                "stream_options",
                "stream_options apply to a stream (stream: true); a whole response has usage",
            )
        return None

    def limit(self) -> int | None:
        """The requested number of tokens, or None when the request leaves it to the server."""
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, model_defaults: dict[str, Any]) -> SamplingParams:
        """SamplingParams of this request; unset fields from `model_defaults`, then OpenAI's.

        Raises:
            ValueError: a value SamplingParams refuses.
        """
        chosen = {
            name: getattr(self, name)
            if getattr(self, name) is not None
            else model_defaults.get(name, default)
            for name, default in OPENAI_DEFAULTS.items()
        }
        return SamplingParams(
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()},
            **chosen,
        )


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
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # template variables (vLLM's)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refusal(self) -> tuple[str, str] | None:
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            return "max_tokens", "max_tokens and max_completion_tokens are one setting: give one value"
        return super().refusal()

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template expects them."""
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]
