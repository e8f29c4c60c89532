"""One request's run: the `Generation` it yields, the prompt cache, GPU floor and trace around it, and
the token loop (the prompt's forward, then a token a forward until max tokens, a stop or a cancel).
`Engine.stream` checks the request and runs it here."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.engine.detokenize import TextStream
from moestream.engine.logits import DeviceLogits
from moestream.engine.loop import ContinuationError, Step, token_stream
from moestream.engine.prompt_cache import KVState
from moestream.engine.sampling import Sampler, SamplingParams, TokenLogprob
from moestream.engine.stats import GenerationStats, PhaseStats
from moestream.engine.tools import ToolCall, ToolSession


@dataclass
class Generation:
    """The result of one request."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: GenerationStats
    finish_reason: str = "length"  # "length", "stop" (eos or a stop string) or "cancelled"
    done: bool = False  # set on the last object `Engine.stream` yields
    piece: str = ""  # the text new since the previous yield; the pieces join to exactly `text`
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache (not computed again)
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, with params.logprobs
    # with tools: the calls read so far (`text` and `piece` are then the content beside them)
    tool_calls: list[ToolCall] = field(default_factory=list)


def run_request(
    engine: Any,
    ids: list[int],
    params: SamplingParams,
    cancelled: Callable[[], bool],
    request_id: str,
    cache_prompt: bool,
    keep: bool,
    tools: ToolSession | None = None,
    slot: int | None = None,
) -> Iterator[Generation]:
    """Run one request (`Engine.stream` checked it): the GPU floor held, the prompt cache taken and
    kept, the trace flushed at the end; yields the growing `Generation`. `slot`: the KV-cache slot the
    request holds among several running at once (`engine/batch.py`: its forwards batched with theirs,
    the slot's own prompt cache), or None (one request at a time)."""
    if engine.floor is not None:
        engine.floor.begin()
    prompt_cache = engine.prompt_cache if slot is None else engine.batch.caches[slot]
    # the held cache is taken out for the run: a request that fails never leaves a half-updated one
    state = prompt_cache.take(ids) if cache_prompt else KVState()
    if not cache_prompt:
        prompt_cache.clear()
    try:
        try:
            step = _stepper(engine, request_id, len(state.ids), slot)
            yield from _tokens(engine, ids, params, cancelled, step, state, tools)
        except ContinuationError as exc:  # raised before the first token: run the request cold instead
            prompt_cache.disable(f"transformers cannot continue this model's KV cache ({exc})")
            warnings.warn(f"the prompt cache is off for this model: {prompt_cache.disabled}", stacklevel=2)
            state = KVState()
            step = _stepper(engine, request_id, 0, slot)
            yield from _tokens(engine, ids, params, cancelled, step, state, tools)
    finally:
        if keep:
            prompt_cache.keep(state)
        if engine.recorder is not None:
            engine.recorder.flush()  # a process killed later loses none of this request's rows
        if engine.floor is not None:
            engine.floor.end()


def _stepper(engine: Any, request_id: str, position: int, slot: int | None = None) -> Step:
    """The forward step, its checkpoint files checked after it (in `slot`: handed to the batch's rounds,
    which check them once a round), telling the trace recorder and the routing replay (if any) what each
    forward covers."""
    if slot is not None:  # the batch's rounds check the files and tell the trace each row's request
        return engine.batch.step(slot, request_id)
    forward = engine.streaming.checked(engine.runner)  # each forward: its shards unchanged, or no token
    listeners = [x for x in (engine.recorder, engine.replay) if x is not None]
    if not listeners:
        return forward
    phase = "prefill"

    def step(ids: list[int], cache: Any, greedy: bool = False) -> tuple[torch.Tensor | DeviceLogits, Any]:
        nonlocal position, phase
        for listener in listeners:
            listener.forward(request_id, phase, position)
        position, phase = position + len(ids), "decode"
        return forward(ids, cache, greedy=greedy)

    # no step started ahead (`ModelRunner.launch`) while a trace records or replays: each forward is told
    # to them once, before it runs, and a step not started is called
    return step


def _tokens(
    engine: Any,
    ids: list[int],
    params: SamplingParams,
    cancelled: Callable[[], bool],
    step: Step,
    state: KVState,
    tools: ToolSession | None = None,
) -> Iterator[Generation]:
    eos = eos_ids(engine.model, engine.tokenizer)
    start, before = time.perf_counter(), engine.counters()
    cached = len(state.ids)
    tokens: list[int] = []
    text = TextStream(engine.tokenizer, params.stop, skip_special=tools is None or not tools.keep_special)
    gen = Generation("", tokens, len(ids), GenerationStats(PhaseStats(), PhaseStats()), cached_tokens=cached)
    sent = 0  # with tools: characters of the content handed out
    if tools is not None:
        gen.tool_calls = tools.calls
    prefill_end, after_prefill = start, before
    grammar = params.output_grammar
    constraint = engine.grammars.constraint(grammar) if grammar is not None else None
    sampler = Sampler(params, len(ids), constraint)
    # closed on leaving: a step started for the next token (`engine/loop.py`) ends before what follows
    with contextlib.closing(
        token_stream(step, ids[cached:], sampler, params.max_tokens, state, sampler.plain)
    ) as stream:
        for token, _ in stream:
            now = time.perf_counter()
            if not tokens:
                prefill_end, after_prefill = now, engine.counters()
                gen.stats.prefill = after_prefill.since(before, len(ids) - cached, now - start)
            else:
                gen.stats.decode = engine.counters().since(after_prefill, len(tokens), now - prefill_end)
            if token in eos and not params.ignore_eos:
                gen.finish_reason = "stop"
                break
            tokens.append(token)
            if sampler.last_logprob is not None:
                gen.logprobs.append(sampler.last_logprob)
            stopped = text.push(token)
            gen.text = text.text
            # a stop string, or the grammar done
            if stopped or (constraint is not None and constraint.stopped):
                gen.finish_reason = "stop"
                break
            if cancelled():
                gen.finish_reason = "cancelled"
                break
            if tools is None:
                gen.piece = text.piece()
            else:
                tools.update(text.settled(), final=False)
                if tools.done:  # parallel_tool_calls off: the first call is the answer
                    gen.finish_reason = "stop"
                    break
                gen.text, gen.piece, sent = tools.content, tools.content[sent:], len(tools.content)
            yield gen
    gen.piece = text.finish()
    gen.text, gen.done = text.text, True
    if tools is not None:
        tools.update(text.text, final=True)
        gen.text, gen.piece = tools.content, tools.content[sent:]  # what no yield carried yet
        if tools.calls and gen.finish_reason == "stop":
            gen.finish_reason = "tool_calls"
    gen.stats.gpu_floor = (
        "off" if engine.floor is None else ("active" if engine.floor.was_active else "inactive")
    )
    yield gen


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) or getattr(
        model.config, "eos_token_id", None
    )
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found
