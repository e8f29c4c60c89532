"""The prompt cache: the KV cache of the last request, reused for the longest common token prefix.

llama-server's `cache_prompt`: a multi-turn chat re-sends the whole conversation, and all but the new
turn is already in the KV cache of the previous request. On a streamed MoE the prompt forward reads
nearly every expert, so prefilling only the new tokens saves most of the wait and most of the bytes.

A transformers cache is cropped back to the common prefix when every layer can be: full-attention
layers always; sliding-window layers while they still hold every token; linear-attention (recurrent)
layers never, as their state folds in all past tokens. Otherwise only an exact continuation (the new
prompt extends everything the cache holds) reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVState:
    """A KV cache and the token ids fed through it. `valid` is False while a forward runs: a forward that
    raised leaves some layers updated and others not, and such a cache is never reused."""

    kv: Any = None
    ids: list[int] = field(default_factory=list)
    valid: bool = True


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _croppable(kv: Any) -> bool:
    for layer in getattr(kv, "layers", None) or []:
        if "LinearAttention" in type(layer).__name__:
            return False
        window = getattr(layer, "sliding_window", None)
        if window is not None and layer.get_seq_length() >= window:
            return False  # the oldest tokens are gone already; they cannot be restored
    return hasattr(kv, "crop")


def crop(kv: Any, remove: int) -> bool:
    """Drop the last `remove` tokens of `kv` in place; False when that is not possible (the cache is then
    left as it was, or must be discarded if the crop failed half-way)."""
    if remove == 0:
        return True
    if not _croppable(kv):
        return False
    try:
        kv.crop(-remove)  # a negative count means "remove this many" in every transformers 5 release
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


class PromptCache:
    """Holds at most one KVState between requests (the engine serves one request at a time)."""

    def __init__(self) -> None:
        self.held = KVState()
        self.disabled: str | None = None  # why the model's cache cannot be continued, once that is known

    def disable(self, reason: str) -> None:
        self.disabled, self.held = reason, KVState()

    def take(self, ids: list[int]) -> KVState:
        """A state to run prompt `ids` from: the held cache cropped to the common prefix (at most
        len(ids) - 1 tokens, since the last prompt token must be fed to get logits), or an empty one.
        The held cache is handed over either way."""
        held, self.held = self.held, KVState()
        if held.kv is None or not held.valid or self.disabled:
            return KVState()
        n = min(common_prefix(held.ids, ids), len(ids) - 1)
        if n == 0 or not crop(held.kv, len(held.ids) - n):
            return KVState()
        return KVState(held.kv, held.ids[:n])

    def keep(self, state: KVState) -> None:
        """Hold `state` for the next request (only a cache whose last forward completed)."""
        self.held = state if state.valid and state.kv is not None and not self.disabled else KVState()

    def clear(self) -> None:
        self.held = KVState()

    @property
    def tokens(self) -> int:
        return len(self.held.ids)

    def nbytes(self) -> int:
        """Bytes of the tensors the held cache keeps alive."""
        return cache_bytes(self.held.kv)


def cache_bytes(kv: Any) -> int:
    """Bytes of every tensor held by a transformers cache's layers (keys, values, recurrent states), or
    of the positions a native runner's cache holds (`held_bytes`)."""
    held = getattr(kv, "held_bytes", None)
    if held is not None:
        return held()
    total = 0
    for layer in getattr(kv, "layers", None) or []:
        for value in vars(layer).values():
            items = (
                value.values()
                if isinstance(value, dict)
                else value
                if isinstance(value, (list, tuple))
                else [value]
            )
            # 0-d tensors are bookkeeping (a sliding window's size), not cached states
            total += sum(
                t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor) and t.dim()
            )
    return total
