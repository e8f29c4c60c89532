"""The token loop: prefill, then one forward per token through the model's own KV cache."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from moestream.engine.prompt_cache import KVState
from moestream.runtime.experts import raised_in_experts


class ForwardStep:
    """Calls a transformers causal LM one step at a time, whatever its cache argument is called
    (`past_key_values` up to transformers 5.23, `cache` from 5.24).

    With `static` (a transformers StaticCache, engine/trunk.py) every request runs in that one cache: a
    request that starts without one gets it emptied, and with `graphs` (DecodeGraphs) a one-token step
    replays them instead of launching the trunk's ops one by one.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.trim_logits = "logits_to_keep" in params
        self.device = next(model.parameters()).device
        self.static: Any = None
        self.graphs: Any = None
        self.one_graph = False  # the whole step as one graph when every expert is in the GPU tier
        self.runner: Any = None  # a native runner (ggml graphs) computing the step instead of transformers

    def logits(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """ids [1, T] on the model's device -> (last position's logits [V] fp32 on the device, cache)."""
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
        if self.trim_logits:
            kwargs["logits_to_keep"] = 1
        if cache is not None:
            kwargs[self.cache_arg] = cache
        out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[0, -1].float(), new_cache

    @torch.inference_mode()
    def __call__(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
        """Feed `ids` after what `cache` holds; returns (last-position logits [V] fp32, cache)."""
        if self.runner is not None:
            return self.runner(ids, cache)
        if self.static is not None and cache is None:
            self.static.reset()  # a request from scratch: positions and states back to empty
            cache = self.static
        if self.graphs is not None and len(ids) == 1:
            return self.graphs.step(ids[0]), cache
        logits, new_cache = self.logits(torch.tensor([ids], device=self.device), cache)
        return logits.cpu(), new_cache  # sampling runs on the host


def token_stream(
    step: ForwardStep,
    prompt: list[int],
    sample: Callable[[torch.Tensor, list[int]], int],
    max_tokens: int,
    state: KVState,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (token, logits it was sampled from) up to `max_tokens`; the caller decides when to stop.

    `state` holds what is already cached (a reused prompt prefix, or nothing) and `prompt` the prompt
    tokens after it. `state.ids` grows with every token fed, so it always says what the cache holds;
    `sample` gets those ids (the prompt and the tokens generated so far) for its penalties.
    """
    logits = _continue(step, prompt, state) if state.ids else _feed(step, prompt, state)
    for i in range(max_tokens):
        token = sample(logits, state.ids)
        yield token, logits
        if i + 1 < max_tokens:
            logits = _feed(step, [token], state)


class ContinuationError(Exception):
    """transformers could not feed several tokens after a reused cache (transformers 5.24's DeepSeek
    attention, for one, fails on that shape); nothing has been generated yet, so a cold run can follow."""


def _continue(step: ForwardStep, ids: list[int], state: KVState) -> torch.Tensor:
    try:
        return _feed(step, ids, state)
    except (RuntimeError, ValueError, IndexError) as exc:
        if raised_in_experts(exc):  # a failing expert read or kernel says nothing about the KV cache
            raise
        raise ContinuationError(f"{type(exc).__name__}: {exc}") from exc


def _feed(step: ForwardStep, ids: list[int], state: KVState) -> torch.Tensor:
    state.valid = False  # until the forward has returned: a failed one leaves the cache half-updated
    logits, state.kv = step(ids, state.kv)
    state.ids.extend(ids)
    state.valid = True
    return logits
