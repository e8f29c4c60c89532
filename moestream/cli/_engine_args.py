"""Engine options shared by generate, serve, bench and demo."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from moestream.cli._power_args import add_gpu_floor_argument
from moestream.errors import MoestreamError


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """PATH as the first argument, or as `-m/--model PATH` (llama.cpp's spelling), or a model by name,
    `-hf/--hf-repo REPO[:QUANT]` (llama.cpp's), downloaded into the HF cache."""
    parser.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="checkpoint directory, GGUF file (first part of a split), or REPO[:QUANT] as with -hf",
    )
    parser.add_argument("-m", "--model", dest="model_path", metavar="PATH", help="the same as PATH")
    add_hf_argument(parser)


def add_hf_argument(parser: Any) -> None:
    """`-hf/--hf-repo REPO[:QUANT]` (a parser or a mutually exclusive group)."""
    parser.add_argument(
        "-hf",
        "--hf-repo",
        metavar="REPO[:QUANT]",
        default=None,
        help="a model on the Hugging Face hub, downloaded into its cache (HF_HOME) once: the GGUF whose "
        "name holds QUANT (every part of a split; default Q4_K_M where there are several), or the "
        "safetensors checkpoint of a repo without GGUF files; offline (HF_HUB_OFFLINE=1) the cache serves",
    )


def model_path(args: argparse.Namespace) -> str:
    """The checkpoint the user named, once; a model by name (-hf) is downloaded here, where missing."""
    given = [v for v in (args.path, args.model_path, args.hf_repo) if v is not None]
    if len(given) != 1:
        raise MoestreamError(
            "name the checkpoint once: as PATH, -m PATH or -hf REPO[:QUANT]"
            if given
            else "no checkpoint given: pass PATH (or -m PATH, or -hf REPO[:QUANT])"
        )
    if args.hf_repo is not None:
        from moestream.store.hub import fetch

        return str(fetch(args.hf_repo))
    return given[0]


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    """--ctx-size and --chat-template (generate, serve)."""
    parser.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens a request may use, prompt and generation (default: the smaller of the "
        "model's maximum and 8192)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file to use instead of the tokenizer's",
    )


def add_dtype_argument(group: Any) -> None:
    """--dtype (the engine's options, and plan's)."""
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype (default: the checkpoint's)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--cache",
        default="auto",
        help="expert cache budget, e.g. 512MiB, 2GiB, or auto (default): the largest cache that fits in "
        "the memory left after the trunk, the KV cache at the context, the graphs' buffers and the "
        "process's libraries, under every memory cgroup and MemAvailable; every expert when they all "
        "fit (the mode line says which limit decided it)",
    )
    group.add_argument(
        "--device",
        default="cpu",
        help="compute device: cpu, cuda or cuda:N (default cpu); cuda runs ggml's CUDA backend (`make "
        "native CUDA=1`) where it runs the model, else the torch CUDA path (--trunk graphs|layer-graphs|"
        "static|eager, --unified or an integrated GPU unless --trunk ggml, or no ggml CUDA library); the "
        "mode line says which and why",
    )
    group.add_argument(
        "--gpu-cache",
        default=None,
        help="CUDA: GPU expert cache, a size or auto. On ggml's CUDA backend the same as --gpu-tier; on the "
        "torch CUDA path the GPU slots, auto: what free VRAM leaves after the trunk, KV cache and "
        "activations (default: --cache)",
    )
    group.add_argument(
        "--gpu-tier",
        default=None,
        help="ggml's CUDA backend (--device cuda): device slots for the routed experts, a size (e.g. "
        "2GiB), filled by --policy from the host expert cache (--cache), which reads from disk the "
        "experts it lacks; auto (the default): every expert on the GPU where they fit in its free memory, "
        "else a tier of what is left",
    )
    group.add_argument(
        "--host-cache",
        default=None,
        help="CUDA: the host expert cache between disk and GPU. On ggml's CUDA backend the same as "
        "--cache; on the torch CUDA path pinned host slots, a size (0: staging only) or auto: what RAM "
        "leaves, none when the GPU holds every expert (default: auto when --cache is, else 0)",
    )
    group.add_argument(
        "--unified",
        action="store_const",
        const=True,
        default=None,
        help="CUDA, the torch path: one pinned, device-mapped tier read in place by the GPU, no staging "
        "copy (default there on integrated GPUs such as Jetson); --cache sets its size",
    )
    group.add_argument(
        "--io-mode",
        default="direct",
        choices=["direct", "pagecache", "mmap"],
        help="how expert bytes are read: O_DIRECT, buffered pread, or through a memory map",
    )
    group.add_argument(
        "--io-threads",
        type=int,
        default=None,
        help="dedicated I/O threads (default 4; 8 on ggml's CUDA backend)",
    )
    group.add_argument("--piece", default="128KiB", help="size of one read (default 128KiB)")
    group.add_argument(
        "--threads",
        "-t",
        type=int,
        default=None,
        help="compute threads in total, on one pool (default: the physical cores)",
    )
    add_dtype_argument(group)
    group.add_argument(
        "--trunk-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dequantize the non-expert weights a GGUF stores in block types (Q8_0, Q6_K, ...) into "
        "this dtype (default: keep them quantized, computed on their blocks; more memory, maybe faster)",
    )
    group.add_argument(
        "--trunk",
        default="auto",
        choices=["auto", "ggml", "graphs", "layer-graphs", "static", "eager"],
        help="how attention, norms and routers run: ggml (each decoder layer a ggml graph built by "
        "moestream, the routed experts streamed between them, on the CPU's one thread pool or ggml's "
        "CUDA backend), graphs "
        "(CUDA graphs between the MoE layers' experts, over a static KV cache; when every expert fits the "
        "GPU tier, all are read at load and the whole step is one graph), layer-graphs (never that one "
        "graph), static (the static cache, each op launched from Python), eager (transformers' own "
        "dynamic cache) or auto (default: ggml where the model has graphs, on the CPU or with --device cuda "
        "on ggml's CUDA backend; graphs on the torch CUDA path; else eager); graphs, layer-graphs, static "
        "and eager with --device cuda take the torch CUDA path; the mode line says which ran",
    )
    group.add_argument(
        "--policy",
        default="lru",
        choices=["lru", "lfu", "predictive"],
        help="cache eviction: lru (default); lfu, the expert used least often since the start; or "
        "predictive, the expert least likely to be used soon, learned from the routing (falls back to "
        "lfu or lru where they do better; compare them on a trace with `moestream simulate`)",
    )
    group.add_argument("--no-mlock", action="store_true", help="do not lock the expert cache in memory")
    group.add_argument(
        "--no-preload",
        action="store_true",
        help="when the cache (on CUDA: the GPU tier) holds every expert, read each on first use instead "
        "of all at load (the default reads them at load, so that no request waits for a disk read; on "
        "CUDA it also makes the step one graph)",
    )
    group.add_argument(
        "--prefetch",
        nargs="?",
        const="on",
        default="off",
        choices=["off", "on", "auto"],
        help="while a layer computes, read ahead the experts the next layer's router confidently picks for "
        "its input; --prefetch (= on) always, --prefetch auto only while the disk has idle time",
    )
    group.add_argument(
        "--experts-per-token",
        type=int,
        default=None,
        metavar="N",
        help="LOSSY: route every token to N experts instead of the model's top-k (for read-volume "
        "experiments; printed in the mode line)",
    )
    add_gpu_floor_argument(group)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    extra = {"ctx_size": args.ctx_size} if getattr(args, "ctx_size", None) is not None else {}
    return dict(
        **extra,
        cache=args.cache,
        device=args.device,
        gpu_cache=args.gpu_cache,
        gpu_tier=args.gpu_tier,
        host_cache=args.host_cache,
        unified=args.unified,
        experts_per_token=args.experts_per_token,
        policy=args.policy,
        prefetch=args.prefetch,
        io_mode=args.io_mode,
        io_threads=args.io_threads,
        piece=args.piece,
        threads=args.threads,
        dtype=args.dtype,
        trunk_dtype=args.trunk_dtype,
        trunk=args.trunk,
        lock_memory=not args.no_mlock,
        preload=not args.no_preload,
        gpu_floor=args.gpu_floor,
    )


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """--trace FILE and --no-trace-predict (generate, serve, bench)."""
    parser.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="record every layer's routing of every request to FILE (Parquet; see `moestream simulate`)",
    )
    parser.add_argument(
        "--no-trace-predict",
        action="store_true",
        help="do not record the stale-gate prediction of the next layers' experts",
    )


def warn_trace_predict(args: argparse.Namespace) -> None:
    """--no-trace-predict changes what --trace records: alone it changes nothing."""
    if args.no_trace_predict and not args.trace:
        warnings.warn(
            "--no-trace-predict changes what --trace records, and no --trace was given", stacklevel=2
        )


def read_chat_template(args: argparse.Namespace) -> str | None:
    """The --chat-template file's text, read before the model loads so that a bad path fails at once."""
    if getattr(args, "chat_template", None) is None:
        return None
    from moestream.engine.chat import read_template

    return read_template(args.chat_template)


def use_chat_template(engine: Any, template: str | None) -> None:
    """Replace the tokenizer's chat template with --chat-template's."""
    if template is None:
        return
    if engine.tokenizer is None:
        raise MoestreamError("--chat-template needs a tokenizer, and this checkpoint has none")
    engine.tokenizer.chat_template = template
