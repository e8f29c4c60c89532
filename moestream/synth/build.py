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
from typing import Any

import moestream
from moestream.errors import MoestreamError
from moestream.synth.configs import build_config
from moestream.synth.layout import TensorSpec, checkpoint_tensors, expert_layout
from moestream.synth.noise import NoiseSource
from moestream.synth.shapes import DTYPES, SynthSpec, resolve_spec
from moestream.synth.tokenizer import DEFAULT_VOCAB, IM_END, save_tokenizer
from moestream.synth.weights import InitScheme, chunks_for
from moestream.synth.writer import TensorData, write_checkpoint
from moestream.units import round_up

SYNTH_MARKER = "moestream_synth.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3


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
) -> Path:
    """Write a random-weight checkpoint of `arch` (or of `preset`, overridden by explicit sizes).

    The directory gets a genuine transformers config.json and generation_config.json, a byte-level
    BPE tokenizer with a ChatML template, the weights as safetensors (sharded at `shard_bytes`, with
    model.safetensors.index.json), and moestream_synth.json marking the checkpoint as synthetic.
    `on_progress(done, total)` is called as tensor bytes are written (for progress bars).

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
    tok = save_tokenizer(tmp, DEFAULT_VOCAB)
    vocab = spec.vocab_size or round_up(tok["size"], 64)
    if vocab < tok["size"]:
        raise MoestreamError(f"vocab size {vocab} is smaller than the {tok['size']}-token tokenizer")
    cfg = build_config(spec, vocab, eos_id=tok["eos"], pad_id=tok["eos"])
    cfg.save_pretrained(str(tmp))
    _save_generation_config(tmp, eos_ids=[tok["eos"], tok["im_end"]], pad_id=tok["eos"])
    model = meta_model(cfg, spec.dtype)
    specs = checkpoint_tensors(
        model,
        spec.arch,
        spec.dtype,
        experts=spec.experts,
        hidden=spec.hidden,
        moe_intermediate=spec.moe_intermediate,
        mxfp4=spec.mxfp4,
    )
    scheme = InitScheme() if spec.realistic_routing else InitScheme.plain()
    source = NoiseSource(spec.seed)
    data = [
        TensorData(s.name, s.dtype, s.shape, partial(chunks_for, s, scheme, source, model, spec.seed))
        for s in specs
    ]
    files = write_checkpoint(tmp, data, shard_bytes, _progress_counter(data, on_progress))
    marker = synth_marker(spec, scheme, specs, files, vocab, tok["size"], time.perf_counter() - t0)
    (tmp / SYNTH_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _progress_counter(
    data: list[TensorData], on_progress: Callable[[int, int], None] | None
) -> Callable[[int], None] | None:
    """Turn per-chunk byte counts into on_progress(done, total) calls."""
    if on_progress is None:
        return None
    total = sum(t.nbytes for t in data)
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        on_progress(done, total)

    on_progress(0, total)
    return on_bytes


def meta_model(cfg: Any, dtype: str = "bf16") -> Any:
    """The transformers CausalLM of `cfg` on the meta device: names, shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPES[dtype]))


def _save_generation_config(tmp: Path, eos_ids: list[int], pad_id: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id).save_pretrained(str(tmp))


def synth_marker(
    spec: SynthSpec,
    scheme: InitScheme,
    specs: list[TensorSpec],
    files: list[str],
    vocab: int,
    tokenizer_size: int,
    seconds: float,
) -> dict[str, Any]:
    """Contents of moestream_synth.json: the synth parameters, byte counts and `"synthetic": true`."""
    expert_bytes = sum(s.nbytes for s in specs if s.routed)
    return {
        "synthetic": True,
        "generator": f"moestream synth {moestream.__version__}",
        "preset": spec.preset,
        "arch": spec.arch,
        "layers": spec.layers,
        "experts": spec.experts,
        "top_k": spec.top_k,
        "hidden": spec.hidden,
        "moe_intermediate": spec.moe_intermediate,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "mxfp4": spec.mxfp4,
        "realistic_routing": spec.realistic_routing,
        "init": {"std": scheme.std, "embed_scale": scheme.embed_scale, "out_scale": scheme.out_scale},
        "vocab_size": vocab,
        "tokenizer_size": tokenizer_size,
        "expert_layout": expert_layout(spec.arch, spec.mxfp4),
        "moe_layers": len({s.layer for s in specs if s.routed}),
        "expert_bytes": expert_bytes,
        "total_bytes": sum(s.nbytes for s in specs),
        "files": files,
        "seconds": round(seconds, 3),
        "chat_stop_token": IM_END,
    }
