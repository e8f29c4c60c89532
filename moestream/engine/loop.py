"""The token loop: prefill, then one forward per token through the model's own KV cache, each forward
by the engine's `ModelRunner` (engine/runners.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from moestream.engine.logits import DeviceLogits
from moestream.engine.prompt_cache import KVState
from moestream.runtime.experts import raised_in_experts

# a forward: (ids fed after what the cache holds, the cache, greedy=) -> (last-position logits [V], the
# cache); a `ModelRunner` (engine/runners.py), or one wrapped by the request (trace, checks)
Step = Callable[..., tuple[torch.Tensor | DeviceLogits, Any]]


def token_stream(
    step: Step,
    prompt: list[int],
    sample: Callable[[torch.Tensor | DeviceLogits, list[int]], int],
    max_tokens: int,
    state: KVState,
    greedy: bool = False,
) -> Iterator[tuple[int, torch.Tensor | DeviceLogits]]:
    """Yields (token, logits it was sampled from) up to `max_tokens`; the caller decides when to stop.

    `state` holds what is already cached (a reused prompt prefix, or nothing) and `prompt` the prompt
    tokens after it. `state.ids` grows with every token fed, so it always says what the cache holds;
    `sample` gets those ids (the prompt and the tokens generated so far) for its penalties. `greedy`:
    `sample` takes the argmax alone (`Sampler.plain`); each step is told, and may return `DeviceLogits`.
    """
    first = _continue if state.ids else _feed
    logits = first(step, prompt, state, greedy)
    for i in range(max_tokens):
        token = sample(logits, state.ids)
        yield token, logits
        if i + 1 < max_tokens:
            logits = _feed(step, [token], state, greedy)


class ContinuationError(Exception):
    """transformers could not feed several tokens after a reused cache (transformers 5.24's DeepSeek
    attention, for one, fails on that shape); nothing has been generated yet, so a cold run can follow."""


def _continue(step: Step, ids: list[int], state: KVState, greedy: bool) -> torch.Tensor | DeviceLogits:
    try:
        return _feed(step, ids, state, greedy)
    except (RuntimeError, ValueError, IndexError) as exc:
        if raised_in_experts(exc):  # a failing expert read or kernel says nothing about the KV cache
            raise
        raise ContinuationError(f"{type(exc).__name__}: {exc}") from exc


def _feed(step: Step, ids: list[int], state: KVState, greedy: bool) -> torch.Tensor | DeviceLogits:
    state.valid = False  # until the forward has returned: a failed one leaves the cache half-updated
    logits, state.kv = step(ids, state.kv, greedy=greedy)
    state.ids.extend(ids)
    state.valid = True
    return logits
