"""`moestream synth OUT`: write a random-weight HF checkpoint (or GGUF file) of a real MoE architecture."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.units import format_size, parse_size

_PROGRESS_MIN_BYTES = 256 << 20  # smaller writes finish before a bar is worth drawing
_PROGRESS_LINE_SECONDS = 30.0  # without a terminal: one progress line this often
_SIZES = ("layers", "experts", "top_k", "hidden", "moe_intermediate", "vocab_size", "seed")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `synth` verb."""
    p = subparsers.add_parser(
        "synth",
        help="write a random-weight HF checkpoint of a real MoE architecture",
        description="Write a random-weight HF checkpoint (config, tokenizer, safetensors) of a real MoE "
        "architecture, tensor by tensor. Weights are scaled so that routing stays token-driven "
        "like a trained model's; the checkpoint is marked synthetic in moestream_synth.json.",
    )
    p.add_argument("out", metavar="OUT", help="directory to create (a .gguf file with --format gguf)")
    p.add_argument(
        "--format",
        choices=("safetensors", "gguf"),
        help="safetensors (HF checkpoint directory) or gguf (one llama.cpp file); default: gguf when OUT "
        "ends in .gguf or --quant is given",
    )
    p.add_argument(
        "--quant",
        help="GGUF quantization as llama-quantize makes it: Q4_K_M (default), Q5_K_M, Q8_0, MXFP4_MOE, "
        "or BF16 (unquantized, like convert_hf_to_gguf.py)",
    )
    p.add_argument("--threads", help="GGUF quantization threads (default: every CPU)")
    p.add_argument(
        "--preset", help="qwen3-30b-a3b, olmoe-1b-7b, gpt-oss-20b or demo; explicit sizes override it"
    )
    p.add_argument(
        "--arch",
        help="model_type: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v2, deepseek_v3, "
        "glm4_moe, qwen3_next, qwen3_5_moe, gpt_oss",
    )
    p.add_argument("--layers", help="decoder layers")
    p.add_argument("--experts", help="routed experts per MoE layer")
    p.add_argument("--top-k", dest="top_k", help="experts picked per token")
    p.add_argument("--hidden", help="hidden size")
    p.add_argument(
        "--moe-intermediate", dest="moe_intermediate", help="intermediate size of one routed expert"
    )
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--seed", default="0", help="random seed (default 0)")
    p.add_argument("--shard-size", dest="shard_size", default=None, help="maximum shard size (default 2GiB)")
    p.add_argument("--vocab-size", dest="vocab_size", help="config vocab size (default: tokenizer size)")
    p.add_argument(
        "--mxfp4", action="store_true", help="gpt_oss only: MXFP4 experts like the released gpt-oss"
    )
    p.add_argument(
        "--plain-init",
        dest="plain_init",
        action="store_true",
        help="transformers' default init (deep layers then route most tokens to a few experts)",
    )
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists and is not empty")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Synthesize the checkpoint and print what was written."""
    from moestream.synth.build import SYNTH_MARKER, synthesize

    sizes = {name: _int_arg(name, getattr(args, name)) for name in _SIZES}
    shard_bytes = _size_arg("--shard-size", args.shard_size or "2GiB")
    threads = _int_arg("threads", args.threads)
    if threads is not None and threads < 1:
        raise MoestreamError(f"--threads must be at least 1, not {threads}")
    fmt = args.format or ("gguf" if args.quant or str(args.out).endswith(".gguf") else "safetensors")
    if fmt == "gguf" and args.shard_size is not None:
        warnings.warn("--shard-size splits safetensors shards; --format gguf writes one file", stacklevel=2)
    if fmt == "safetensors" and threads is not None:
        warnings.warn(
            "--threads quantizes a GGUF synth; a safetensors one is written on one thread", stacklevel=2
        )
    t0 = time.perf_counter()
    with _progress_bar() as on_progress:
        out = synthesize(
            args.out,
            arch=args.arch,
            preset=args.preset,
            dtype=args.dtype,
            shard_bytes=shard_bytes,
            mxfp4=args.mxfp4,
            realistic_routing=not args.plain_init,
            force=args.force,
            on_progress=on_progress,
            format=fmt,
            quant=args.quant,
            threads=threads,
            **{k: v for k, v in sizes.items() if v is not None},
        )
    seconds = time.perf_counter() - t0
    if fmt == "gguf":
        from moestream.synth.gguf_meta import read_synth_marker

        marker = read_synth_marker(out) or {}
    else:
        marker = json.loads((Path(out) / SYNTH_MARKER).read_text())
    print(summary(out, marker, seconds))
    return 0


def summary(out: Path, marker: dict, seconds: float) -> str:
    """Lines printed after a synth: what, where, how big, how fast."""
    what = f"{marker['arch']}" + (f" (preset {marker['preset']})" if marker.get("preset") else "")
    gguf = marker.get("format") == "gguf"
    stored = marker["quant"] if gguf else ("mxfp4" if marker["mxfp4"] else marker["dtype"])
    shape = (
        f"{marker['layers']} layers, {marker['moe_layers']} MoE x {marker['experts']} experts, "
        f"top-{marker['top_k']}, hidden {marker['hidden']}, expert intermediate "
        f"{marker['moe_intermediate']}, {stored}"
    )
    total = marker["total_bytes"]
    rate = total / (1 << 20) / seconds if seconds > 0 else float("inf")
    weights = "realistic-routing init" if marker["realistic_routing"] else "plain init"
    if gguf:
        types = ", ".join(f"{t} x{n}" for t, n in marker["tensor_types"].items())
        where = f"one GGUF file ({types} tensors)"
    else:
        files = [f for f in marker["files"] if f.endswith(".safetensors")]
        where = f"{len(files)} safetensors file{'s' if len(files) != 1 else ''}"
    return "\n".join(
        [
            f"wrote {out}: synthetic {what}, {weights}",
            f"  {shape}",
            f"  expert bytes {format_size(marker['expert_bytes'])}, total {format_size(total)} in {where}",
            f"  {seconds:.1f} s, {rate:.1f} MiB/s",
        ]
    )


def _int_arg(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(str(text).replace("_", ""))
    except ValueError:
        raise MoestreamError(f"--{name.replace('_', '-')} must be an integer, not {text!r}") from None


def _size_arg(flag: str, text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise MoestreamError(f"{flag} must be a byte size such as 2GiB or 512MiB, not {text!r}") from None
    if value < 1:
        raise MoestreamError(f"{flag} must be larger than zero")
    return value


@contextmanager
def _progress_bar() -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr, shown once a write is known to be large enough to need one."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    state: dict[str, int] = {}
    lines = _ProgressLines() if not sys.stderr.isatty() else None

    def on_progress(done: int, total: int) -> None:
        if total < _PROGRESS_MIN_BYTES:
            return
        if lines is not None:
            lines.update(done, total)
            return
        if "task" not in state:
            progress.start()
            state["task"] = progress.add_task("writing", total=total)
        progress.update(state["task"], completed=done)

    try:
        yield on_progress
    finally:
        if "task" in state:
            progress.stop()


class _ProgressLines:
    """Progress as a plain line every 30 s, for logs (a bar needs a terminal)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._last = self._t0

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self._last < _PROGRESS_LINE_SECONDS and done < total:
            return
        self._last = now
        rate = done / (1 << 20) / max(now - self._t0, 1e-9)
        print(
            f"writing: {format_size(done)} of {format_size(total)} ({100 * done / total:.0f}%), "
            f"{now - self._t0:.0f} s, {rate:.1f} MiB/s",
            file=sys.stderr,
            flush=True,
        )
