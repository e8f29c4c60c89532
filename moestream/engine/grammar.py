"""Constrained decoding: the token mask of a grammar, by llguidance (vLLM's `guidance` backend, and
llama.cpp's when built with it; why this one and not xgrammar: docs/server.md, BENCHMARKS.md).

A request's output format is one grammar text: a JSON schema (`response_format` json_schema, or
llama-server's `json_schema`), any JSON object (`json_object`), or a Lark grammar (a tool call in the
model's own format, engine/tools/). `Grammars` (one per engine) holds the tokenizer as llguidance sees
it, built once on first use, and checks a grammar before a request is queued; `Constraint` is one
request's matcher: the sampler masks every token's logits with it and feeds it the token drawn.

JSON is compiled without free whitespace (", " and ": " between items, as `json.dumps` writes), so a
document ends where its last bracket closes: the matcher stops there and so does the generation, whatever
the weights would have written next.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from moestream.errors import MoestreamError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(MoestreamError):
    """A schema or grammar that cannot be compiled; `param` names the request field it came from."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


def response_format_grammar(response_format: Any, json_schema: Any = None) -> str | None:
    """The grammar text OpenAI's `response_format` (or llama-server's `json_schema`) asks for; None for
    plain text.

    Raises:
        GrammarError: a malformed response_format, or both fields given.
    """
    if json_schema is not None:
        if response_format not in (None, {"type": "text"}):
            raise GrammarError("give response_format or json_schema, not both", "json_schema")
        return _from_schema(json_schema, "json_schema")
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise GrammarError('response_format must be an object with a "type"')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _from_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError(
                'response_format json_schema must be {"json_schema": {"name": ..., "schema": {...}}}'
            )
        return _from_schema(spec.get("schema", {}), "response_format")
    raise GrammarError(f"response_format type {kind[:40]!r} is not one of text, json_object, json_schema")


def _from_schema(schema: Any, param: str) -> str:
    import llguidance

    if isinstance(schema, bool):  # true: any JSON value; false: nothing at all
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object", param)
    try:
        # the options override the schema's own "x-guidance": free whitespace would never end
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}", param) from None
    check(grammar, param)
    return grammar


def check(grammar: str, param: str, tokenizer: Any = None) -> None:
    """Raises GrammarError, naming llguidance's complaint, when `grammar` cannot be compiled (against
    `tokenizer` where it names tokens)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(f"the {_what(param)} cannot be compiled: {_first_line(error)}", param)


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON value of `schema` inside a Lark grammar (llguidance's `%json` with this module's options)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=True)


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammars:
    """The engine's tokenizer as llguidance sees it (built on first use: about a second for a 150K-token
    vocabulary) and the check of a grammar against it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: set[int]) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                if self.hf_tokenizer is None:
                    raise GrammarError("this model has no tokenizer, so its output cannot be constrained")
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=n_vocab, eos_token=self.eos or None
                )
            return self._tokenizer

    def check(self, grammar: str, param: str = "grammar") -> None:
        """`check` against this tokenizer (a grammar that names special tokens needs it)."""
        check(grammar, param, self.tokenizer)

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One request's matcher: `mask` the logits of the next token, `accept` the token drawn; `stopped`
    once the grammar is complete and admits nothing more."""

    def __init__(self, grammars: Grammars, grammar: str) -> None:
        import llguidance

        self.vocab = grammars.vocab_size
        self.matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {_first_line(self.matcher.get_error())}")
        words = (grammars.tokenizer.vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)

    def mask(self, scores: torch.Tensor) -> None:
        """Set the logits [V] of every token the grammar forbids next to -inf, in place."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].view(np.bool_)
        scores.masked_fill_(torch.from_numpy(~allowed), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # the mask allowed it: a bug, never a user's error
            raise RuntimeError(f"the grammar refused token {token}: {_first_line(self.matcher.get_error())}")

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()


def _first_line(error: str) -> str:
    return error.strip().split("\n")[0][:300]


def _what(param: str) -> str:
    return {"response_format": "JSON schema", "json_schema": "JSON schema", "grammar": "grammar"}.get(
        param, f"{param} grammar"
    )
