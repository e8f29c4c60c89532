"""Which GPU path `--device cuda` runs (issue 31: one GPU path), decided once, before the model is built.

- ggml's CUDA backend (the fast path): the per-family ggml graphs of the CPU path on ggml-cuda, a GPU
  tier of expert slots (`--gpu-tier`, or `--gpu-cache` as its synonym; `auto` by default: every expert
  on the GPU where they fit, else a tier of what is left, `engine/gpu_tier.py`) over a host expert cache
  in RAM (`--cache`, or `--host-cache` as its synonym; `auto` by default). The run is then the one
  `MOESTREAM_GGML_BACKEND=cuda --device cpu` gives: torch's device is the CPU, the graphs compute on the
  GPU (`EngineOptions.ggml_device`).
- the torch CUDA path (transformers modules in CUDA graphs, the Triton GGUF kernels, `--gpu-cache` and
  `--host-cache` as the GPU and pinned host tiers, `--unified`), only where ggml's CUDA backend cannot run:
  `--trunk graphs|layer-graphs|static|eager` or `--unified` asked for, a model the ggml graphs do not
  run, or no ggml CUDA library (or no GPU it sees). The mode line says which of these it was.

`choose` is the rule, a pure function; `resolve` gathers its inputs (the model's config, ggml's CUDA
probe) and turns `moestream.load`'s arguments into the options of the path chosen, refusing
contradictory ones in one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moestream.errors import MoestreamError
from moestream.units import parse_size

CPU, GGML_CUDA, TORCH = "cpu", "ggml-cuda", "torch"
# the trunk modes that are the torch CUDA path's own (CUDA graphs, a static cache, transformers eager)
TORCH_TRUNKS = ("graphs", "layer-graphs", "static", "eager")


@dataclass(frozen=True)
class GpuPath:
    """The path a run takes: CPU, GGML_CUDA or TORCH, and (TORCH) the mode line's words why."""

    path: str
    why: str = ""


def choose(device: str, trunk: str, unified: bool, no_graph: str | None, cuda_missing: str | None) -> GpuPath:
    """The path for `device` ("cpu", "cuda", "cuda:N") with `--trunk trunk`; `unified`: --unified asked
    for, or an integrated GPU's default (`resolve` says which);
    `no_graph`: why the ggml graphs do not run the model (None: they do); `cuda_missing`: why ggml's CUDA
    backend cannot run here (None: it can).

    Raises:
        MoestreamError: `--trunk ggml` on a CUDA device where ggml's CUDA backend cannot run it (or with
            --unified, which is the torch path's).
    """
    if not device.startswith("cuda"):
        return GpuPath(CPU)
    if trunk in TORCH_TRUNKS:
        return GpuPath(TORCH, f"--trunk {trunk} asked")
    if unified:
        blocked: str | None = "--unified: one device-mapped tier"
    elif no_graph is not None:
        blocked = f"the ggml graphs do not run this model: {no_graph}"
    else:
        blocked = cuda_missing
    if blocked is None:
        return GpuPath(GGML_CUDA)
    if trunk == "ggml":
        raise MoestreamError(
            f"--trunk ggml --device {device} runs ggml's CUDA backend, not possible here: {blocked}"
        )
    return GpuPath(TORCH, blocked)


def resolve(config: Any, device: str, given: dict[str, Any]) -> tuple[str, dict[str, Any], GpuPath]:
    """`moestream.load`'s device and options (`given`: the other `EngineOptions` fields passed, `cache`
    among them) for the path `choose` gives the model of `config`: on ggml's CUDA backend the device "cpu"
    and the options of that run (`ggml_options`); on the torch path the device and options as given, the
    words why in `gpu_path_why`.

    Raises:
        MoestreamError: contradictory sizes, or an option of the other path (in one sentence).
    """
    if not str(device).startswith("cuda"):
        return device, given, GpuPath(CPU)
    trunk = given.get("trunk", "auto")
    unified = given.get("unified")
    # an integrated GPU (Jetson: its memory the host's) keeps the torch path's one device-mapped tier unless
    # --trunk ggml or --unified false says otherwise: ggml's CUDA backend would hold a host cache and a GPU
    # tier of the same experts in the one memory
    integrated = unified is None and trunk != "ggml" and _integrated(device)
    no_graph = cuda_missing = None
    if trunk not in TORCH_TRUNKS and unified is not True and not integrated:
        from moestream.graphs import config_no_graph

        no_graph = config_no_graph(config)
        if no_graph is None:
            from moestream.ggml.backend import cuda_unavailable

            cuda_missing = cuda_unavailable(gpu_index(device))
    chosen = choose(device, trunk, bool(unified) or integrated, no_graph, cuda_missing)
    if integrated and chosen.path == TORCH and chosen.why.startswith("--unified"):
        chosen = GpuPath(TORCH, "an integrated GPU: one device-mapped tier, as --unified")
    if chosen.path == GGML_CUDA:
        return "cpu", ggml_options(device, given), chosen
    if given.get("gpu_tier") is not None:
        raise MoestreamError(
            f"--gpu-tier sizes the GPU tier of ggml's CUDA backend, which does not run here ({chosen.why}): "
            "on the torch CUDA path the GPU tier is --gpu-cache"
        )
    return device, {**given, "gpu_path_why": chosen.why}, chosen


def ggml_options(device: str, given: dict[str, Any]) -> dict[str, Any]:
    """`given` (`--device cuda`'s options) as the options of ggml's CUDA backend's run: the host expert
    cache `cache` (`--host-cache` its synonym), the GPU tier `gpu_tier` (`--gpu-cache` its synonym; auto
    by default), the GPU `ggml_device`; `unified` False is what this path does anyway.

    Raises:
        MoestreamError: two sizes for one tier, or `--host-cache 0` (the torch path's staging only).
    """
    out = {k: v for k, v in given.items() if k not in ("gpu_cache", "host_cache", "unified", "gpu_path_why")}
    host = _one_size("--cache", given.get("cache", "auto"), "--host-cache", given.get("host_cache"))
    if host not in (None, "auto") and _size(host) == 0:
        raise MoestreamError(
            "--host-cache 0 (pinned staging only) is the torch CUDA path's; ggml's CUDA backend keeps a host "
            "expert cache between disk and GPU: give it a size or auto"
        )
    tier = _one_size("--gpu-tier", given.get("gpu_tier"), "--gpu-cache", given.get("gpu_cache"))
    out.update(cache=host or "auto", gpu_tier=tier or "auto", ggml_device=device)
    return out


def _integrated(device: str) -> bool:
    """Whether `device` is an integrated GPU: as ggml's CUDA backend sees it where that backend runs here
    (so that the path it is chosen for never starts torch's CUDA, whose context, allocator and libraries'
    pages cost host memory the expert cache could have); else as torch sees it (False where torch sees
    no CUDA device)."""
    from moestream.ggml.backend import cuda_device_type

    kind = cuda_device_type(gpu_index(device))
    if kind is not None:
        return kind == "igpu"
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        props = torch.cuda.get_device_properties(gpu_index(device))
    except (RuntimeError, AssertionError):  # no such GPU: the path's own checks say so later
        return False
    return bool(getattr(props, "is_integrated", False))


def gpu_index(device: str) -> int:
    """N of "cuda:N" (0 for "cuda").

    Raises:
        MoestreamError: N is not a whole number.
    """
    _, _, index = str(device).partition(":")
    if not index:
        return 0
    if not index.isdigit():
        raise MoestreamError(f"device {device!r}: say cuda or cuda:N, N a GPU's number")
    return int(index)


def _one_size(name: str, value: Any, other: str, second: Any) -> Any:
    """The size two synonyms give (None or auto where neither gives one).

    Raises:
        MoestreamError: they give two different sizes.
    """
    a = None if _auto(value) else value
    b = None if _auto(second) else second
    if a is not None and b is not None and _size(a) != _size(b):
        raise MoestreamError(
            f"{name} {value} and {other} {second} both size one tier on ggml's CUDA backend (--device cuda): "
            "give one of them"
        )
    return a if a is not None else b


def _auto(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "auto")


def _size(value: Any) -> Any:
    try:
        return parse_size(value)
    except (TypeError, ValueError):
        return value  # EngineOptions names the bad size
