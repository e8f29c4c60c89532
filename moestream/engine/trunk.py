"""How the trunk (everything but the routed experts) of a decode step runs: `--trunk`.

- eager: transformers' own forward, op by op, over its dynamic KV cache (the behaviour before graphs).
- static: the same forward over one transformers StaticCache of --ctx-size tokens that every request
  runs in (prefill and decode), op by op: the graphs' oracle, bit for bit.
- graphs: that static cache, prefill op by op, and each one-token decode step replayed as CUDA graphs
  between the MoE layers' experts (engine/trunk_graphs.py); when the GPU tier can hold every expert,
  they are all read at load and the whole step, experts included, is one graph (runtime/resident.py).
- layer-graphs: graphs, never the one-graph step (to compare, or to keep reading experts on demand).
- auto: graphs on a CUDA device when the model's step can be captured, else eager; the mode line says
  which ran and, when graphs were not possible, why.
"""

from __future__ import annotations

from typing import Any

import torch

from moestream.engine.loop import ForwardStep
from moestream.engine.trunk_graphs import DecodeGraphs, GraphsUnavailable
from moestream.errors import MoestreamError
from moestream.runtime.resident import ResidentExperts, unavailable


def _static_cache(model: torch.nn.Module, tokens: int) -> Any:
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=tokens)


def ggml_spec(model: torch.nn.Module, mode: str, device: torch.device) -> tuple[Any, str | None]:
    """The ggml graphs' spec of `model` when `mode` (auto on the CPU, or ggml) runs them: (spec, None);
    else (None, the reason auto fell back, or None when the mode never asked for them).

    Raises:
        MoestreamError: `--trunk ggml` was asked for and this model has no graph (yet).
    """
    if mode not in ("auto", "ggml") or device.type != "cpu":
        return None, None
    from moestream.model.graph_spec import NoGraph, graph_spec

    try:
        return graph_spec(model, model.config), None
    except NoGraph as exc:
        if mode == "ggml":
            raise MoestreamError(f"--trunk ggml is not possible for this model: {exc}") from None
        return None, str(exc)


def setup_trunk(
    step: ForwardStep,
    mode: str,
    modules: list[tuple[int, Any]],
    device: torch.device,
    ctx_size: int,
    threads: int = 1,
    spec: Any = None,
    no_graph: str | None = None,
) -> str:
    """Give `step` the runner, static cache and graphs `mode` asks for; returns the mode line's part.
    `spec`, `no_graph`: what `ggml_spec` said.

    Raises:
        MoestreamError: `--trunk graphs` was asked for and this model's step cannot be captured.
    """
    asked = mode
    if spec is not None:
        step.runner = _ggml_runner(step.model, spec, dict(modules), ctx_size, threads)
        return step.runner.describe()
    if mode == "auto":
        mode = "graphs" if device.type == "cuda" else "eager"
        if no_graph is not None:
            return f"trunk eager (transformers: {no_graph})"
    step.one_graph = mode == "graphs"
    if mode == "eager":
        return "trunk eager (dynamic KV cache)"
    cache = _static_cache(step.model, ctx_size)
    graphs = DecodeGraphs(lambda ids: step.logits(ids, cache)[0], cache, dict(modules), device)
    try:
        if mode == "static":
            graphs.trial()
        else:
            graphs.capture()
    except GraphsUnavailable as exc:
        if asked != "auto":
            raise MoestreamError(f"--trunk {asked} is not possible for this model: {exc}") from None
        return f"trunk eager (CUDA graphs not possible: {exc})"
    step.static = cache
    if mode == "static":
        return f"trunk static KV cache of {ctx_size} tokens, eager ops"
    step.graphs = graphs
    return f"{graphs.describe()} over a static KV cache of {ctx_size} tokens"


def _ggml_runner(
    model: torch.nn.Module, spec: Any, modules: dict[int, Any], ctx_size: int, threads: int
) -> Any:
    """The ggml graphs' runner of `model`, whose routed experts stream through `modules`' runtimes."""
    from moestream.engine.ggml_runner import GgmlRunner
    from moestream.model.arch import num_experts

    experts = num_experts(model.config)
    return GgmlRunner(spec, lambda layer: modules[layer].runtime, ctx_size, experts, threads)


def resident_part(step: ForwardStep, top_k: int, hidden_size: int) -> str:
    """(Re)build the one-graph step over every expert resident in the GPU tier, where the tier the
    experts modules are bound to now can hold them all (at load, and after each restream); returns the
    mode line's words for it ("" when the tier cannot hold them all or graphs are off).

    Raises:
        ExpertReadError: reading an expert failed (the split graphs stay in use).
    """
    graphs = step.graphs
    if graphs is None or not step.one_graph:
        return ""
    graphs.drop_whole()
    runtime = next(iter(graphs.modules.values())).runtime
    if unavailable(runtime, top_k) is not None:
        return ""
    resident = ResidentExperts(runtime, top_k)
    resident.load_all(hidden_size, next(step.model.parameters()).dtype)
    try:
        graphs.capture_whole(resident)
    except GraphsUnavailable as exc:
        return f"; every expert in the GPU tier, but not one graph a token: {exc}"
    return "; every expert resident in the GPU tier (read at load): one graph a token"


def release_trunk(step: ForwardStep) -> None:
    """Drop the graphs and the static cache (engine close): their GPU memory goes back at once."""
    step.graphs = step.static = None
    if step.runner is not None:
        step.runner.close()
        step.runner = None
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
