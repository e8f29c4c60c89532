"""`synthesize`: write a random-weight HF checkpoint of a real MoE architecture, tensor by tensor.

Everything goes into a hidden sibling directory first and is renamed into place at the end, so an
interrupted synth leaves no half checkpoint under the requested name.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.synth.marker import progress_counter, synth_marker
from moestream.synth.prepare import meta_model, prepare
from moestream.synth.shapes import SynthSpec, resolve_spec
from moestream.synth.weights import chunks_for
from moestream.synth.writer import TensorData, write_checkpoint

SYNTH_MARKER = "moestream_synth.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
# meta_model and synth_marker live in prepare/marker; importers of build keep finding them here
__all__ = ["SYNTH_MARKER", "meta_model", "prepare", "synth_marker", "synthesize"]


def synthesize(
    out_dir: str | os.PathLike[str],
    *,
    arch: str | None = None,
    layers: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    hidden: int | None = None,
    moe_intermediate: int | None = None,
    dtype: str = "bf16",
    preset: str | None = None,
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    mxfp4: bool = False,
    realistic_routing: bool = True,
    vocab_size: int | None = None,
    force: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    format: str = "safetensors",
    quant: str | None = None,
    threads: int | None = None,
) -> Path:
    """Write a random-weight checkpoint of `arch` (or of `preset`, overridden by explicit sizes).

    The directory gets a genuine transformers config.json and generation_config.json, a byte-level
    BPE tokenizer with a ChatML template, the weights as safetensors (sharded at `shard_bytes`, with
    model.safetensors.index.json), and moestream_synth.json marking the checkpoint as synthetic.
    `on_progress(done, total)` is called as tensor bytes are written (for progress bars).

    With `format="gguf"`, `out_dir` is the GGUF file to write instead: the same model (same values
    for the same arguments and seed) in llama.cpp's layout, quantized to `quant` (Q4_K_M, Q5_K_M,
    Q8_0, MXFP4_MOE or BF16; default Q4_K_M) with llama.cpp's per-tensor type choices, on `threads`
    threads (default: every CPU), the synth marker in its `moestream.synth` metadata.

    Raises:
        MoestreamError: bad sizes or names, or `out_dir` exists and is not empty (without `force`).
    """
    spec = resolve_spec(
        preset,
        arch=arch,
        layers=layers,
        experts=experts,
        top_k=top_k,
        hidden=hidden,
        moe_intermediate=moe_intermediate,
        dtype=dtype,
        seed=seed,
        mxfp4=mxfp4,
        realistic_routing=realistic_routing,
        vocab_size=vocab_size,
    )
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise MoestreamError(f"shard size must be a positive number of bytes, not {shard_bytes!r}")
    out = Path(out_dir)
    if format == "gguf":
        return _synthesize_gguf(out, spec, quant or "Q4_K_M", threads, force, on_progress)
    if format != "safetensors":
        raise MoestreamError(f"unknown format {format!r} (choose from safetensors, gguf)")
    if quant is not None:
        raise MoestreamError("--quant is for --format gguf; safetensors synths are written in --dtype")
    _check_target(out, force)
    tmp = out.parent / f".{out.name}.synth-partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _write_all(tmp, spec, shard_bytes, on_progress)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MoestreamError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MoestreamError(f"{out} exists and is not empty (use --force to overwrite it)")


def _move_into_place(tmp: Path, out: Path) -> None:
    old = None
    if out.is_dir():
        old = out.parent / f".{out.name}.synth-old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_all(
    tmp: Path, spec: SynthSpec, shard_bytes: int, on_progress: Callable[[int, int], None] | None
) -> None:
    """Tokenizer, configs, weights and the synth marker, in that order, into `tmp`."""
    t0 = time.perf_counter()
    p = prepare(tmp, spec)
    data = [
        TensorData(s.name, s.dtype, s.shape, partial(chunks_for, s, p.scheme, p.source, p.model, spec.seed))
        for s in p.specs
    ]
    total = sum(t.nbytes for t in data)
    files = write_checkpoint(tmp, data, shard_bytes, progress_counter(total, on_progress))
    seconds = time.perf_counter() - t0
    marker = synth_marker(spec, p.scheme, p.specs, files, p.vocab, p.tokenizer_size, seconds)
    (tmp / SYNTH_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _synthesize_gguf(
    out: Path,
    spec: SynthSpec,
    quant: str,
    threads: int | None,
    force: bool,
    on_progress: Callable[[int, int], None] | None,
) -> Path:
    """The GGUF flavour of `synthesize`: scratch files in a hidden sibling directory, then one rename."""
    from moestream.synth.gguf_build import write_gguf
    from moestream.synth.gguf_meta import check_loadable
    from moestream.synth.gguf_quant import normalize_quant

    quant = normalize_quant(quant)
    check_loadable(spec)
    if out.is_dir():
        raise MoestreamError(f"{out} is a directory; --format gguf writes one .gguf file")
    if out.exists() and not force:
        raise MoestreamError(f"{out} exists (use --force to overwrite it)")
    tmp = out.parent / f".{out.name}.synth-partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        p = prepare(tmp, spec)
        path = write_gguf(tmp / out.name, p, quant, threads or os.cpu_count() or 1, on_progress)
        path.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
