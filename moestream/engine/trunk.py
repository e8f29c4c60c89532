"""How the trunk (everything but the routed experts) of a decode step runs: `--trunk` picks the
`ModelRunner` (engine/runners.py) once, at load.

- eager: transformers' own forward, op by op, over its dynamic KV cache (the behaviour before graphs).
- static: the same forward over one transformers StaticCache of --ctx-size tokens that every request
  runs in (prefill and decode), op by op: the graphs' oracle, bit for bit.
- graphs: that static cache, prefill op by op, and each one-token decode step replayed as CUDA graphs
  between the MoE layers' experts (engine/trunk_graphs.py); when the GPU tier can hold every expert,
  they are all read at load and the whole step, experts included, is one graph (runtime/resident.py).
- layer-graphs: graphs, never the one-graph step (to compare, or to keep reading experts on demand).
- ggml (CPU): each decoder layer as ggml graphs, one thread pool (engine/ggml_runner.py); the same graphs
  on ggml's CUDA backend where --device cuda chose it (engine/gpu_path.py: the run's torch device is then
  the CPU).
- auto: on the CPU ggml where the model has a graph, else eager; on a CUDA device (the torch CUDA path,
  where ggml's CUDA backend cannot run) graphs when the model's step can be captured, else eager. The
  mode line says which ran and, when the faster one was not possible, why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moestream.cache.policy import EvictionPolicy, LRUPolicy
from moestream.engine.runners import CudaGraphRunner, EagerRunner, ModelRunner, StaticRunner
from moestream.engine.trunk_graphs import GraphsUnavailable
from moestream.errors import MoestreamError
from moestream.runtime.expert_layers import ExpertLayers


def ggml_spec(
    model: torch.nn.Module, mode: str, device: torch.device, ggml_device: str | None = None
) -> tuple[Any, str | None]:
    """The ggml graphs' spec of `model` when `mode` (auto on the CPU, or ggml) runs them: (spec, None);
    else (None, the reason auto fell back, or None when the mode never asked for them). `ggml_device`:
    --device cuda chose ggml's CUDA backend (`engine/gpu_path.py`), from the config alone.

    Raises:
        MoestreamError: `--trunk ggml` (or --device cuda on ggml's CUDA backend) was asked for and this
            model has no graph (yet).
    """
    if mode not in ("auto", "ggml") or device.type != "cpu":
        return None, None
    from moestream.graphs import NoGraph, graph_spec

    try:
        return graph_spec(model, model.config), None
    except NoGraph as exc:
        if ggml_device is not None:  # the config promised graphs, the built model has a part they lack
            raise MoestreamError(
                f"--device {ggml_device} chose ggml's CUDA backend, and the ggml graphs cannot run this "
                f"model ({exc}): --trunk graphs or eager runs it on the torch CUDA path"
            ) from None
        if mode == "ggml":
            raise MoestreamError(f"--trunk ggml is not possible for this model: {exc}") from None
        return None, str(exc)


def make_runner(
    model: torch.nn.Module,
    mode: str,
    modules: list[tuple[int, Any]],
    device: torch.device,
    ctx_size: int,
    experts: ExpertLayers,
    threads: int = 1,
    spec: Any = None,
    no_graph: str | None = None,
    gpu_tier: int | None = None,
    policy: Callable[[], EvictionPolicy] = LRUPolicy,
    parallel: int = 1,
    trunk_bytes: int = 0,
    backend: Any = None,
    memory: Any = None,
) -> ModelRunner:
    """The runner `mode` asks for (its `describe()`: the mode line's trunk words), reaching the routed
    experts through `experts`. `spec`, `no_graph`: what `ggml_spec` said. `gpu_tier`: bytes of device
    expert slots for the ggml graphs on a backend, filled by `policy` (`engine/gpu_tier.py`). `parallel`:
    the ggml runner's KV-cache slots (sequences decoded together). `trunk_bytes`: the trunk's weights, for
    a GPU tier sized from the device's free memory (`--gpu-tier auto`). `backend`: the ggml backend the
    graphs compute on (`runner_backend`; None: the CPU in place), which the runner then owns, with
    `memory`, its `DeviceMemory` where the trunk was copied there at load (`engine/trunk_release.py`).

    Raises:
        MoestreamError: `--trunk graphs` (or static, layer-graphs) was asked for and this model's step
            cannot be captured (run over a static KV cache); a GPU tier where no ggml backend runs the
            model, or one too small for a token's routed experts; --parallel N > 1 where no ggml graphs
            run the model, or with a GPU tier.
    """
    asked = mode
    if spec is not None:
        from moestream.engine.ggml_runner import GgmlRunner

        args = (spec, experts, ctx_size, threads, backend, gpu_tier, policy)
        return GgmlRunner(*args, slots=parallel, trunk_bytes=trunk_bytes, memory=memory)
    if gpu_tier is not None:
        raise MoestreamError(
            "--gpu-tier sizes the expert slots of the ggml graphs on ggml's CUDA backend (--device cuda), "
            f"which do not run this model here ({no_graph or mode})"
        )
    if parallel > 1:
        why = f"transformers: {no_graph}" if no_graph else f"--trunk {mode}"
        raise MoestreamError(
            f"--parallel {parallel} needs the ggml graphs (the CPU's trunk); this run's trunk ({why}) "
            "runs one request at a time"
        )
    if mode == "auto":
        mode = "graphs" if device.type == "cuda" else "eager"
        if no_graph is not None:
            return EagerRunner(model, f"trunk eager (transformers: {no_graph})")
    if mode == "eager":
        return EagerRunner(model)
    if mode == "static":
        runner: StaticRunner = StaticRunner(model, ctx_size, dict(modules), device, experts)
    else:
        runner = CudaGraphRunner(model, ctx_size, dict(modules), device, experts, one_graph=mode == "graphs")
    try:
        runner.check()
    except GraphsUnavailable as exc:
        if asked != "auto":
            raise MoestreamError(f"--trunk {asked} is not possible for this model: {exc}") from None
        return EagerRunner(model, f"trunk eager (CUDA graphs not possible: {exc})")
    return runner


def backend_name(ggml_device: str | None = None) -> str:
    """The ggml backend the graphs compute on other than the CPU in place: "cuda" where --device cuda chose
    it (`ggml_device`, engine/gpu_path.py) or MOESTREAM_GGML_BACKEND=cuda (GPU 0, with --device cpu);
    "cpu" for MOESTREAM_GGML_BACKEND=cpu (ggml's CPU backend through the same device path, which the tests
    check it by); "": the CPU in place.

    Raises:
        MoestreamError: MOESTREAM_GGML_BACKEND names another backend than --device cuda's, or none known.
    """
    import os

    name = os.environ.get("MOESTREAM_GGML_BACKEND", "").strip()
    if name not in ("", "cuda", "cpu"):
        raise MoestreamError(f"MOESTREAM_GGML_BACKEND={name!r}: say cuda or cpu")
    if ggml_device is not None:
        if name == "cpu":
            raise MoestreamError(
                f"MOESTREAM_GGML_BACKEND=cpu and --device {ggml_device} ask for two backends: give one"
            )
        return "cuda"
    return name


def runner_backend(spec: Any, threads: int, ggml_device: str | None = None) -> Any:
    """The ggml backend (`backend_name`) that the graphs of `spec` compute on, started (the caller owns it
    until `make_runner` hands it to the runner); None: the CPU in place, or no graphs (`spec` None).

    Raises:
        MoestreamError: as `backend_name`.
        GgmlUnavailableError: ggml's CUDA backend cannot start (no library, no GPU).
    """
    name = backend_name(ggml_device) if spec is not None else ""
    if not name:
        return None
    from moestream.engine.gpu_path import gpu_index
    from moestream.ggml.backend import cpu_backend, cuda_backend

    if name == "cpu":
        return cpu_backend(threads)
    return cuda_backend(gpu_index(ggml_device) if ggml_device is not None else 0)
