"""Sampling parameters and the sampler: transformers' logits processors, then argmax or a seeded draw.

The processors run in the order transformers' `generate` applies them (logit bias, repetition penalty,
then temperature, top-k, top-p, min-p), so a request behaves as the same settings do in
`model.generate`. OpenAI's presence and frequency penalties have no transformers processor; they are the
small `PresenceFrequencyPenalty` below.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moestream.engine.logits import DeviceLogits

# the settings a model's generation_config.json may give as defaults (vLLM's `--generation-config auto`)
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# OpenAI's ranges
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
# a log-probability of -inf (a token the grammar, top-k or top-p excluded) as JSON can carry it (vLLM's)
NO_PROBABILITY = -9999.0


@dataclass
class SamplingParams:
    """What to generate. temperature 0 means greedy; top_k 0, top_p 1, min_p 0 and the penalties at 1 and 0
    disable those."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # transformers' (CTRL) penalty over prompt and generated tokens
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI's, over generated tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # the output's format: OpenAI's response_format ({"type": "json_object"}, {"type": "json_schema",
    # "json_schema": {"schema": {...}}}), llama-server's json_schema (a schema), or a llguidance grammar
    # text (what the tool calls' formats build); one of the three
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | bool | None = None
    grammar: str | None = None
    # the log-probability of every token drawn, and of the `logprobs` most likely (0: the drawn one's only)
    logprobs: int | None = None
    # the grammar the output is held to: `grammar`, or the one response_format / json_schema compile to
    output_grammar: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]  # one stop string, as OpenAI's API accepts; not a list of its characters
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:  # NaN fails every comparison
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator accepts
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self.output_grammar = self.grammar
        if self.response_format is not None or self.json_schema is not None:
            from moestream.engine.grammar import GrammarError, response_format_grammar

            formatted = response_format_grammar(self.response_format, self.json_schema)
            if formatted is not None and self.grammar is not None:
                raise GrammarError("give response_format (or json_schema) or a grammar, not both")
            self.output_grammar = formatted or self.grammar
        if self.output_grammar is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a response format: the grammar ends it")

    def unused_when_greedy(self) -> list[str]:
        """The sampling-only settings given (top_p, top_k, min_p, seed) that greedy decoding (temperature
        0) never reads: the callers warn about them."""
        if not is_greedy(self.temperature):
            return []
        off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None}
        return [name for name, value in off.items() if getattr(self, name) != value]


class PresenceFrequencyPenalty:
    """OpenAI's penalties: logit[j] -= frequency x count(j) + presence x (count(j) > 0), counted over the
    generated tokens only (as vLLM does); transformers has no such processor."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # input_ids [1, L] (prompt then generated), scores [1, V]
        generated = input_ids[0, self.prompt_len :]
        if generated.numel() == 0:
            return scores
        counts = torch.bincount(generated, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def build_processors(params: SamplingParams, prompt_len: int) -> list:
    """The processors `params` asks for, in transformers' order (empty: plain argmax / softmax)."""
    from transformers.generation import logits_process as lp

    processors: list = []
    if params.logit_bias:
        # the {(token,): bias} form: transformers 5.17 refuses token 0 in the [[[token], bias]] form
        bias = {(t,): float(b) for t, b in params.logit_bias.items()}
        processors.append(lp.SequenceBiasLogitsProcessor(bias))
    if params.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(
            PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_len)
        )
    if not is_greedy(params.temperature):  # the warpers only shape a distribution that is sampled from
        if params.temperature != 1.0:
            processors += [_shift_to_zero_max, lp.TemperatureLogitsWarper(params.temperature)]
        if params.top_k:
            processors.append(lp.TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            processors.append(lp.TopPLogitsWarper(params.top_p))
        if params.min_p > 0:
            processors.append(lp.MinPLogitsWarper(params.min_p))
    return processors


def is_greedy(temperature: float) -> bool:
    """0, or a temperature that is 0 in float32 (below ~1e-45), where dividing the logits by it would give
    NaN: greedy, as vLLM takes any temperature below 1e-5."""
    return float(torch.tensor(temperature, dtype=torch.float32)) == 0


def _shift_to_zero_max(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Largest logit to 0 before dividing by the temperature: softmax is unchanged, and a tiny temperature
    sends the others to -inf (greedy, ties shared) instead of overflowing every logit to inf (NaN probs)."""
    return scores - scores.max(dim=-1, keepdim=True).values


@dataclass
class TokenLogprob:
    """A drawn token's log-probability under the distribution it was drawn from (after the grammar's
    mask, penalties and temperature), and the `top` most likely tokens' (id, log-probability), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class Sampler:
    """Picks the next token from last-position logits [V], given every token so far (prompt + generated).

    With a `constraint` (engine/grammar.py) every token the grammar forbids is masked first and the
    token drawn is fed to it; with `params.logprobs` set, `last_logprob` is the drawn token's."""

    def __init__(self, params: SamplingParams, prompt_len: int = 0, constraint: Any = None) -> None:
        self.params = params
        self.constraint = constraint
        self.last_logprob: TokenLogprob | None = None
        self.processors = build_processors(params, prompt_len)
        self.greedy = is_greedy(params.temperature)
        # greedy with nothing to shape or report: the argmax of the logits as they are (`__call__`)
        self.plain = self.greedy and not self.processors and constraint is None and params.logprobs is None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:  # a non-deterministic seed for this generator alone (torch.seed() also reseeded torch's
            # global generators, CUDA's included: 0.6 ms a request, and a side effect on the caller's RNG)
            self.generator.seed()

    def __call__(self, logits: torch.Tensor | DeviceLogits, context: list[int] | None = None) -> int:
        if isinstance(logits, DeviceLogits):  # left on the device beside their argmax (numpy's)
            if self.plain:
                return logits.token
            logits = logits.tensor()
        if self.plain and logits.dtype is torch.float32 and logits.is_cpu:  # the same argmax, fewer steps
            return int(logits.numpy().argmax())
        if self.constraint is None:
            scores = logits.float()[None]  # [1, V]
        else:  # masked in place: never the runner's own buffer
            scores = logits.to(torch.float32, copy=True)[None]
            self.constraint.mask(scores[0])
        if self.processors:
            ids = torch.tensor([context or []], dtype=torch.long)  # [1, L]
            for processor in self.processors:
                scores = processor(ids, scores)
        if self.greedy:  # numpy's argmax on the host: 10x torch's single-threaded one on 150k logits
            row = scores[0]
            token = int(np.argmax(row.numpy()) if row.device.type == "cpu" else torch.argmax(row))
        else:
            probs = torch.softmax(scores[0], dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.params.logprobs is not None:
            self.last_logprob = token_logprob(scores[0], token, self.params.logprobs)
        if self.constraint is not None:
            self.constraint.accept(token)
        return token


def token_logprob(scores: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """log_softmax of the processed scores [V]: the drawn token's value and the `top` largest."""
    logprobs = torch.log_softmax(scores, dim=-1)
    best = torch.topk(logprobs, top) if top else None
    pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprob(token, _finite(float(logprobs[token])), [(t, _finite(v)) for t, v in pairs])


def _finite(value: float) -> float:
    return value if value != float("-inf") else NO_PROBABILITY


def model_sampling_defaults(path: Path) -> dict[str, Any]:
    """The sampling settings in the checkpoint's generation_config.json (only those it names), used
    where a server request gives none. A file that is unreadable or out of range is ignored with a warning."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        found = {k: data[k] for k in MODEL_DEFAULT_KEYS if isinstance(data, dict) and data.get(k) is not None}
        SamplingParams(**found)
    except (OSError, ValueError, TypeError) as exc:
        warnings.warn(f"ignoring the sampling defaults of {file}: {exc}", stacklevel=2)
        return {}
    return found
