"""Perplexity of a text in consecutive chunks of `ctx` tokens, scored the way llama.cpp's perplexity
tool scores them, so figures are comparable: every chunk is one forward pass from an empty context,
the first half only gives context, and each token of the second half is scored given all before it.

With moestream only the expert bytes move; the arithmetic is the same for every cache budget and io
mode, so the figure must not change with them (the tests hold it to 1e-6 relative, and to stock
transformers on the same chunks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moestream.errors import MoestreamError


@dataclass
class PerplexityResult:
    """exp(mean negative log-likelihood) over every scored token of every chunk."""

    ctx: int
    chunks: int
    scored_tokens: int = 0
    nll_sum: float = 0.0
    running: list[float] = field(default_factory=list)  # perplexity after each chunk

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.scored_tokens) if self.scored_tokens else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity}


def split_chunks(ids: list[int], ctx: int, chunks: int) -> list[list[int]]:
    """The first `chunks` whole chunks of `ctx` tokens (fewer when the text is shorter).

    Raises:
        MoestreamError: ctx is below 4 tokens, or the text does not fill one chunk.
    """
    if ctx < 4:
        raise MoestreamError(f"--ctx must be at least 4 tokens, got {ctx}")
    if chunks < 1:
        raise MoestreamError(f"--chunks must be at least 1, got {chunks}")
    available = len(ids) // ctx
    if available == 0:
        raise MoestreamError(f"the text has {len(ids)} tokens, fewer than one chunk of --ctx {ctx}")
    return [ids[i * ctx : (i + 1) * ctx] for i in range(min(chunks, available))]


def chunk_nll(logits: torch.Tensor, chunk: list[int]) -> tuple[float, int]:
    """Sum of -log p(token) over the chunk's second half, and how many tokens that is.

    logits: [ctx, vocab] of one forward over `chunk`; row j predicts token j + 1.
    """
    ctx = len(chunk)
    first = ctx // 2
    logprobs = torch.log_softmax(logits[first : ctx - 1].double(), dim=-1)  # [ctx - 1 - first, vocab]
    targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
    nll = -logprobs.gather(1, targets[:, None]).sum().item()
    return nll, ctx - 1 - first


def model_logits(model: torch.nn.Module) -> Callable[[list[int]], torch.Tensor]:
    """A function chunk -> logits [ctx, vocab] for a transformers causal LM (no KV cache kept)."""
    device = next(model.parameters()).device

    def run(chunk: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = model(torch.tensor([chunk], device=device), use_cache=False)
        return out.logits[0].float().cpu()

    return run


def perplexity(
    logits_of: Callable[[list[int]], torch.Tensor],
    ids: list[int],
    ctx: int,
    chunks: int,
    on_chunk: Callable[[int, PerplexityResult], None] | None = None,
) -> PerplexityResult:
    """Score `ids` in chunks; `on_chunk(i, result_so_far)` is called after every chunk."""
    parts = split_chunks(ids, ctx, chunks)
    result = PerplexityResult(ctx=ctx, chunks=len(parts))
    for i, chunk in enumerate(parts):
        nll, n = chunk_nll(logits_of(chunk), chunk)
        result.nll_sum += nll
        result.scored_tokens += n
        result.running.append(result.perplexity)
        if on_chunk is not None:
            on_chunk(i, result)
    return result
