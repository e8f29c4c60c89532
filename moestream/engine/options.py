"""Engine options, validated once at the edge; sizes accepted as "512MiB"-style strings."""

from __future__ import annotations

from dataclasses import dataclass, fields

from moestream.io.reader import IO_MODES
from moestream.runtime.prefetch import MODES as PREFETCH_MODES
from moestream.runtime.streaming import POLICY_CLASSES, StreamConfig
from moestream.units import parse_size

AUTO = "auto"  # a budget sized from the machine at load (engine/auto_budget.py)

DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_PARALLEL = 64  # sequences decoded together at most (each holds a KV cache of the whole context)
MAX_IO_THREADS = 256  # far past where more threads read faster; thousands exhaust the process's threads
# dedicated I/O threads by default: 4, and 8 on ggml's CUDA backend, whose steps wait on the disk alone (the
# GPU computes a layer in well under a read): on an H100's disk (2026-12-07) 8 read at 87-96% of the
# O_DIRECT ceiling where 4 read at 72-90% and 16 at 74% (BENCHMARKS.md, 12-07 morning)
IO_THREADS, IO_THREADS_GGML_CUDA = 4, 8
POLICIES = tuple(POLICY_CLASSES)  # eviction policies a live engine can run (the simulator has more)
# how the non-expert part of a decode step runs (engine/trunk.py): "graphs" (CUDA graphs between the MoE
# layers' experts, over a static KV cache; the whole step as one graph when every expert fits the GPU
# tier), "layer-graphs" (never the one-graph step), "static" (the same static KV cache, every op launched
# from Python: the graphs' exact oracle), "eager" (transformers' dynamic cache, per-op), "auto" (graphs
# where the device and the model allow them, else eager), "ggml" (CPU: each decoder layer a ggml graph
# built by moestream, engine/ggml_runner.py; auto's choice on the CPU for the families that have one, and
# on ggml's CUDA backend with --device cuda; the other modes there take the torch CUDA path)
TRUNK_MODES = ("auto", "ggml", "graphs", "layer-graphs", "static", "eager")


@dataclass
class EngineOptions:
    """How a model is streamed. See `moestream.load` for the meaning of each field."""

    # "auto": the largest cache the machine's memory leaves after the rest of the run (every expert when
    # they all fit), decided at load (engine/auto_budget.py); or a size
    cache: int | str = AUTO
    device: str = "cpu"
    io_mode: str = "direct"
    io_threads: int | None = None  # None: IO_THREADS, or IO_THREADS_GGML_CUDA on ggml's CUDA backend
    piece: int | str = "128KiB"
    threads: int | None = None
    dtype: str = "auto"
    trunk_dtype: str | None = None  # dequantize block-type trunk weights into this dtype (None: keep them)
    lock_memory: bool = True
    # the torch CUDA path's tiers (on ggml's CUDA backend `moestream.load` maps --gpu-cache onto gpu_tier and
    # --host-cache onto cache, engine/gpu_path.py): GPU expert slots (default: `cache`; "auto": free VRAM's)
    gpu_cache: int | str | None = None
    # pinned host slots between disk and GPU (0: staging only; "auto": what RAM leaves; default auto when
    # `cache` is, else 0)
    host_cache: int | str | None = None
    unified: bool | None = None  # one pinned, device-mapped tier (None: on integrated GPUs only)
    # ggml's CUDA backend (--device cuda, or MOESTREAM_GGML_BACKEND=cuda with --device cpu): device slots for
    # the routed experts filled by the policy from the host cache, which reads from disk the experts it
    # lacks (engine/gpu_tier.py; "auto", --device cuda's default: every expert on the device where they
    # fit, else a tier of what is left; None: every expert on the device)
    gpu_tier: int | str | None = None
    # --device cuda as resolved at load (engine/gpu_path.py), not given by callers: where it runs ggml's
    # CUDA backend, the GPU ("cuda" or "cuda:N"; `device` is then the CPU, torch's side of the run), else
    # None; where it runs the torch CUDA path, the mode line's words why
    ggml_device: str | None = None
    gpu_path_why: str = ""
    policy: str = "lru"  # eviction: lru, lfu (uses since the start), predictive (cache/predictive.py)
    # read the next layer's confident stale-gate guesses while this layer computes: "off" (or False), "on"
    # (or True), or "auto" (only while the disk has idle time; runtime/prefetch.py)
    prefetch: bool | str = False
    experts_per_token: int | None = None  # LOSSY override of the model's top-k (printed in the mode line)
    gpu_floor: str = "auto"  # Jetson GPU clock floor while experts compute off the GPU: auto, off or MHz
    ctx_size: int | None = None  # tokens a request may use, prompt and generation (None: min(model's, 8192))
    trunk: str = "auto"  # one of TRUNK_MODES
    # read every expert at load when the cache holds them all (CPU, unified memory; the GPU tier does so
    # whenever it holds them all): no request then waits for a first read. False: read on first use
    preload: bool = True
    # sequences decoded together (`--parallel`, llama-server's -np): the ggml runner's KV-cache slots,
    # each of `ctx_size` positions (engine/batch.py schedules them); "auto": 4, 2 or 1, chosen at load by
    # the memory plan (engine/auto_budget.py `auto_parallel`; serve's default)
    parallel: int | str = 1
    sysfs_root: str = "/"  # where /sys is (tests point it at a fake tree)

    def __post_init__(self) -> None:
        self.cache = _size_or_auto(self.cache)
        self.piece = parse_size(self.piece)
        self.gpu_cache = self.cache if self.gpu_cache is None else _size_or_auto(self.gpu_cache)
        if self.host_cache is None:
            self.host_cache = AUTO if self.cache == AUTO else 0
        self.host_cache = _size_or_auto(self.host_cache)
        if self.gpu_tier is not None:
            auto = isinstance(self.gpu_tier, str) and self.gpu_tier.strip().lower() == AUTO
            self.gpu_tier = AUTO if auto else parse_size(self.gpu_tier)
            if self.device != "cpu":  # `moestream.load` resolves --device cuda first (engine/gpu_path.py)
                raise ValueError(
                    "--gpu-tier sizes the expert slots of ggml's CUDA backend, whose run's torch device is "
                    "the CPU; on the torch CUDA path the GPU tier is --gpu-cache"
                )
        if self.ggml_device is not None and (self.device != "cpu" or not self.ggml_device.startswith("cuda")):
            raise ValueError(
                f"ggml_device {self.ggml_device!r} with device {self.device!r}: --device cuda sets it, for a "
                "run whose torch device is the CPU"
            )
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device {self.device!r} is not supported (supported: cpu, cuda, cuda:N)")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                why = f" (the torch CUDA path, as {self.gpu_path_why})" if self.gpu_path_why else ""
                raise ValueError(
                    f"device {self.device!r} was asked for, but this torch build sees no CUDA device{why}"
                )
        if self.io_mode not in IO_MODES:
            raise ValueError(f"io mode {self.io_mode!r} is not one of {', '.join(IO_MODES)}")
        if self.io_threads is None:
            self.io_threads = IO_THREADS_GGML_CUDA if self.ggml_device is not None else IO_THREADS
        if not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ValueError(f"io threads must be between 1 and {MAX_IO_THREADS}, got {self.io_threads}")
        if self.piece < 4096 or self.piece % 4096:
            raise ValueError(f"piece size must be a positive multiple of 4 KiB, got {self.piece} bytes")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"compute threads must be at least 1, got {self.threads}")
        if self.experts_per_token is not None and self.experts_per_token < 1:
            raise ValueError(f"experts per token must be at least 1, got {self.experts_per_token}")
        self.prefetch = {False: "off", True: "on"}.get(self.prefetch, self.prefetch)  # type: ignore[arg-type]
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch {self.prefetch!r} is not one of {', '.join(PREFETCH_MODES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"eviction policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.ctx_size is not None and self.ctx_size < 2:
            raise ValueError(f"the context size must be at least 2 tokens, got {self.ctx_size}")
        self.parallel = parallel_value(self.parallel)
        if self.trunk not in TRUNK_MODES:
            raise ValueError(f"trunk mode {self.trunk!r} is not one of {', '.join(TRUNK_MODES)}")
        if self.trunk == "ggml" and self.device != "cpu":  # `moestream.load` resolves --device cuda first
            raise ValueError(
                "--trunk ggml runs with the CPU as torch's device (on a GPU: ggml's CUDA backend)"
            )
        if self.trunk in ("graphs", "layer-graphs") and not self.device.startswith("cuda"):
            raise ValueError(
                f"--trunk {self.trunk} needs a CUDA device (CUDA graphs); use auto, static or eager"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.trunk_dtype is not None and self.trunk_dtype not in DTYPES[1:]:
            raise ValueError(f"trunk dtype {self.trunk_dtype!r} is not one of {', '.join(DTYPES[1:])}")

    @property
    def auto(self) -> bool:
        """Whether a budget is still to be sized from the machine (`engine/auto_budget.py`)."""
        return AUTO in (self.cache, self.gpu_cache, self.host_cache)

    def stream_config(self) -> StreamConfig:
        """The fields that decide how experts are streamed (every budget sized: no "auto" left)."""
        if self.auto:
            raise ValueError("an auto budget is sized at load, before the streaming is built")
        return StreamConfig(**{f.name: getattr(self, f.name) for f in fields(StreamConfig)})


def parallel_value(value: int | str) -> int | str:
    """--parallel's value: the string auto as is, else a whole number of slots, 1 to MAX_PARALLEL.

    Raises:
        ValueError: anything else, in one sentence.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"--parallel takes auto or a number of slots from 1 to {MAX_PARALLEL}, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"--parallel takes auto or a number of slots, got {value!r}")
    if not 1 <= value <= MAX_PARALLEL:
        raise ValueError(f"--parallel must be between 1 and {MAX_PARALLEL}, got {value}")
    return value


def _size_or_auto(value: int | str) -> int | str:
    """The string auto as is, else bytes."""
    return AUTO if isinstance(value, str) and value.strip().lower() == AUTO else parse_size(value)
