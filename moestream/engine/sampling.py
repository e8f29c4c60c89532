"""Sampling parameters and the sampler: greedy at temperature 0, else temperature / top-k / top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """What to generate. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

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
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator accepts
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")


class Sampler:
    """Picks the next token from last-position logits [V]."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        # shifted so the largest is 0 before dividing: softmax is unchanged, and a tiny temperature sends
        # the others to -inf (greedy, ties shared) instead of overflowing every logit to inf (NaN probs)
        logits = logits.float()
        logits = (logits - logits.max()) / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
