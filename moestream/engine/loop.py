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
# a started step (`ModelRunner.launch`): waits for it, returns (logits, cache) as the step's call would
Launched = Callable[[], tuple[torch.Tensor | DeviceLogits, Any]]


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

    A step that can start without waiting (`launch`: a runner's `ModelRunner.launch`, through its
    wrappers; a plainly greedy request's decoded token on ggml's CUDA backend) is started before the
    token is handed out, so that the caller's work on it (stop checks, text, the server's chunk) runs
    while the device computes the next; the KV cache then holds that next token too where the caller
    stops (`state.ids` says so). Closing the generator waits for a started step.
    """
    launch = getattr(step, "launch", None) if greedy else None
    first = _continue if state.ids else _feed
    logits = first(step, prompt, state, greedy)
    for i in range(max_tokens):
        token = sample(logits, state.ids)
        more = i + 1 < max_tokens
        started = _start(launch, [token], state) if more and launch is not None else None
        if more and started is None:  # the runner computes this request's steps when called: ask no more
            launch = None
        try:
            yield token, logits
        finally:
            if started is not None:  # ended (the caller's next token, or the caller gone)
                logits = started()
        if more and started is None:
            logits = _feed(step, [token], state, greedy)


def _start(
    launch: Callable[..., Launched | None], ids: list[int], state: KVState
) -> Callable[[], torch.Tensor | DeviceLogits] | None:
    """Start the greedy step of `ids` (`launch`), or None where the runner computes it only when called;
    what it returns waits for the step and gives its logits, `state` then updated as `_feed` does."""
    state.valid = False  # until the step has ended: a failed one leaves the cache half-updated
    started = launch(ids, state.kv, greedy=True)
    if started is None:
        state.valid = True
        return None

    def end() -> torch.Tensor | DeviceLogits:
        logits, state.kv = started()
        state.ids.extend(ids)
        state.valid = True
        return logits

    return end


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
