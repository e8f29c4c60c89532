"""Request bodies of the OpenAI-compatible endpoints, validated strictly (a string is never an integer).

`null` for an optional field means its default, as the openai package and its wrappers send it. Fields
that change nothing here (user, metadata, store, ...: `IGNORED`) are accepted and ignored; fields whose
meaning we cannot honour (n > 1, audio, the deprecated functions, ...) and fields this server does not
know (another server's sampling knobs: typical_p, mirostat, ...) are refused with a message naming the
field, so a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moestream.engine.sampling import MAX_LOGPROBS, SamplingParams

# the range torch.Generator.manual_seed accepts
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_STOP_STRINGS = 16
# OpenAI's defaults, used where neither the request nor the model's generation_config.json says
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# fields of OpenAI's API that ask for something this server does not do: refused when set to anything
# but their "off" values
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (),  # the deprecated form of tools
    "function_call": ("none",),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "modalities": (["text"],),
}

# fields of OpenAI's API that change nothing a server computes (bookkeeping), and llama.cpp's name of a
# field we have: accepted
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "repeat_penalty"})


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
    # OpenAI's output format ({"type": "json_object"}, {"type": "json_schema", "json_schema": {...}}), or
    # llama-server's json_schema (the schema itself): checked by SamplingParams (engine/grammar.py)
    response_format: dict[str, Any] | None = None
    json_schema: Any = None  # a schema (an object, or true) is checked by SamplingParams

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

    def alternatives(self) -> int | None:
        """Alternatives per token to report with their log-probabilities: None for no log-probabilities."""
        return None

    def sampling(self, max_tokens: int, model_defaults: dict[str, Any]) -> SamplingParams:
        """SamplingParams of this request; unset fields from `model_defaults`, then OpenAI's.

        Raises:
            ValueError: a value SamplingParams refuses.
            GrammarError: a response_format or json_schema that cannot be compiled.
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
            response_format=self.response_format,
            json_schema=self.json_schema,
            logprobs=self.alternatives(),
            **chosen,
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the legacy API's: alternatives per token

    def alternatives(self) -> int | None:
        return self.logprobs

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


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    """A call the assistant made, as a client sends it back in the conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Function(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: Function


class ChatMessage(BaseModel):
    """One message; content is text or a list of text parts. An assistant message may carry the
    tool_calls it made, a tool message the tool_call_id it answers."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

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


class _Name(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: _Name


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: messages rendered through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # template variables (vLLM's)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError:
                pass
        raise ValueError(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusal(self) -> tuple[str, str] | None:
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            return "max_tokens", "max_tokens and max_completion_tokens are one setting: give one value"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().refusal()

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools in OpenAI's shape, as chat templates read them."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def choice(self) -> str | dict[str, Any]:
        """tool_choice as the engine takes it: none, auto, required, or {"name": ...}; OpenAI's default
        is auto with tools and none without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return {"name": self.tool_choice.function.name}
        return self.tool_choice or ("auto" if self.tools else "none")

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates expect them (a call's arguments as an object where they parse)."""
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
