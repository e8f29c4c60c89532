"""`write_gguf`: one synthetic model as a GGUF file that llama.cpp loads, written with bounded memory.

Order of work: plan every tensor (name, shape, type), hand the infos to gguf.GGUFWriter, add the
metadata, write the header, key-values and tensor infos, then stream the data tensor by tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from moestream.synth.gguf_meta import Names, add_general, add_hparams, add_vocab, arch_of
from moestream.synth.gguf_quant import QUANTS, normalize_quant
from moestream.synth.gguf_writer import BlockSource, GgufTensor, plan_tensors, write_data
from moestream.synth.marker import progress_counter, synth_marker

if TYPE_CHECKING:
    from moestream.synth.prepare import Prepared


def write_gguf(
    path: Path,
    p: Prepared,
    quant: str,
    threads: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the model `p` (tokenizer and config.json already in `path`'s directory) to `path`."""
    quant = normalize_quant(quant)
    arch = arch_of(p.spec.arch)
    tensors = plan_tensors(p.specs, Names(p.spec.arch, p.spec.layers), quant, p.spec.layers, p.spec.experts)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, gguf.GGMLQuantizationType[t.type])
    marker = synth_marker(p.spec, p.scheme, p.specs, [path.name], p.vocab, p.tokenizer_size, 0.0)
    del marker["seconds"]  # not known before the data is written
    marker["source_expert_bytes"] = marker["expert_bytes"]  # in --dtype, as the safetensors synth has them
    marker.update(gguf_summary(tensors, quant))
    add_general(w, path.stem, gguf.size_label(*w.get_total_parameter_count()), marker)
    add_hparams(w, p.spec.arch, p.cfg.to_dict(), QUANTS[quant][1])
    add_vocab(w, path.parent, p.vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    try:
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        blocks = BlockSource(p.scheme, p.source, p.model, p.spec.seed)
        total = sum(t.nbytes for t in tensors)
        written = write_data(
            fout, tensors, blocks, w.data_alignment, threads, progress_counter(total, on_progress)
        )
        if written != total:
            raise RuntimeError(f"wrote {written} tensor bytes, planned {total}")
    finally:
        w.close()
    return path


def gguf_summary(tensors: list[GgufTensor], quant: str) -> dict[str, Any]:
    """The GGUF part of the synth marker: format, quantization, stored bytes, tensor count per type."""
    expert = sum(t.nbytes for t in tensors if "_exps." in t.name)
    return {
        "format": "gguf",
        "quant": quant,
        "expert_bytes": expert,
        "total_bytes": sum(t.nbytes for t in tensors),
        "tensor_types": dict(sorted(Counter(t.type for t in tensors).items())),
    }
