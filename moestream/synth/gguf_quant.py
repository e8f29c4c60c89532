"""Which GGML type each tensor of a synthetic GGUF gets: llama.cpp's own choices, re-stated.

A GGUF that llama.cpp users run is made in two steps, and this module reproduces both decisions:

1. `convert_hf_to_gguf.py` (bf16 out): 1-D tensors, `*_norm.weight`, `ffn_gate_inp` (the router)
   and anything not named `*.weight` are F32; every other matrix keeps the checkpoint's bf16.
2. `llama-quantize FTYPE` (`src/llama-quant.cpp`): tensors it may quantize (2-D or more, `*weight`,
   not norms, not the router) get the file type's default type, changed by
   `llama_tensor_get_type_impl` per category (output, token_embd, attn_v, attn_k, attn_output,
   ffn_down) and layer, then a fallback when a row length does not fit the type's block size.

The tensors are visited in llama.cpp's loader order (`weight_name_comparer`: tensors outside `blk.N`
first, then by layer, then by name), because the attn_v rule counts attn_v tensors in that order.
Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import gguf

from moestream.errors import MoestreamError

# the file types `moestream synth --format gguf --quant` writes: default tensor type, llama_ftype
QUANTS: dict[str, tuple[str, gguf.LlamaFileType]] = {
    "Q4_K_M": ("Q4_K", gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": ("Q5_K", gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "Q8_0": ("Q8_0", gguf.LlamaFileType.MOSTLY_Q8_0),
    "MXFP4_MOE": ("MXFP4", gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
    "BF16": ("BF16", gguf.LlamaFileType.MOSTLY_BF16),  # the converter's output, nothing quantized
}
# tensor_type_fallback: a type whose block does not divide the row length -> this one
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def normalize_quant(name: str) -> str:
    """'q4_k_m' -> 'Q4_K_M'; an unknown name is one clear error."""
    key = str(name).upper().replace("-", "_")
    if key not in QUANTS:
        raise MoestreamError(f"unknown GGUF quantization {name!r} (choose from {', '.join(QUANTS)})")
    return key


def block_size(type_name: str) -> int:
    """Weights per block of a GGML type (1 for F32/F16/BF16)."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that get more bits: the first and last eighth and every third in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def ggml_n_dims(ne: Sequence[int]) -> int:
    """ggml_n_dims: dimensions up to the last one above 1 (a [hidden, 1] router row counts as 1-D)."""
    return max([i + 1 for i, n in enumerate(ne) if n > 1] or [1])


def layer_of(name: str) -> int:
    """The N of `blk.N.`, or -1 outside the blocks."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def loader_order(names: Iterable[str]) -> list[str]:
    """Tensor names in llama.cpp's loader (and llama-quantize output) order."""
    return sorted(names, key=lambda n: (layer_of(n), n))


def category(name: str) -> str:
    """llama-quant.cpp's tensor_get_category: exact names first, then substrings in its order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (
        ("attn_qkv.weight", "attn_v"),  # attn_qkv and attn_kv_b count as attn_v (category_is_attn_v)
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return cat
    return "other"


def converter_type(name: str, ndim: int, source: str = "BF16") -> str:
    """The type convert_hf_to_gguf.py gives a tensor when it writes `source` (bf16) output."""
    if ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp" in name or not name.endswith(".weight"):
        return "F32"
    return source


def allows_quantization(name: str, ndim: int) -> bool:
    """llama-quant.cpp's tensor_allows_quantization, for the tensors a synthetic MoE has."""
    return (
        ndim >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
    )


@dataclass
class _State:
    """llama-quantize's counters: the attn_v tensors seen so far and in all."""

    n_attn_v: int
    i_attn_v: int = 0


def tensor_types(
    tensors: Sequence[tuple[str, tuple[int, ...]]], quant: str, n_layer: int, n_expert: int
) -> dict[str, str]:
    """GGML type name of every tensor; `tensors` are (GGUF name, ggml ne) with ne[0] the row length."""
    quant = normalize_quant(quant)
    by_name = dict(tensors)
    order = loader_order(by_name)
    state = _State(n_attn_v=sum(category(n) == "attn_v" for n in order))
    tied = "output.weight" not in by_name
    out: dict[str, str] = {}
    for name in order:
        ne = by_name[name]
        stored = converter_type(name, len(ne))
        if quant == "BF16" or not allows_quantization(name, ggml_n_dims(ne)):
            out[name] = stored
            continue
        chosen = _choose(name, ne, quant, state, n_layer, n_expert, tied)
        out[name] = _fallback(ne[0], chosen)
    return out


def _choose(
    name: str, ne: tuple[int, ...], quant: str, st: _State, n_layer: int, n_expert: int, tied: bool
) -> str:
    """llama_tensor_get_type_impl for the Q4_K_M, Q5_K_M, Q8_0 and MXFP4_MOE file types."""
    new = QUANTS[quant][0]
    cat = category(name)
    if cat == "output" or (tied and cat == "token_embd"):
        if quant == "MXFP4_MOE" or ne[0] % block_size(new) != 0:
            return "Q8_0"
        return new if new == "Q8_0" else "Q6_K"
    if quant == "MXFP4_MOE":  # experts (ne[2] > 1) MXFP4, everything else Q8_0
        return "MXFP4" if len(ne) > 2 and ne[2] > 1 else "Q8_0"
    if cat == "attn_v":
        if quant in ("Q4_K_M", "Q5_K_M") and use_more_bits(st.i_attn_v, st.n_attn_v):
            new = "Q6_K"
        if n_expert == 8:  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
            new = "Q8_0"
        st.i_attn_v += 1
    elif cat == "attn_k" and n_expert == 8:
        new = "Q8_0"
    elif cat == "ffn_down":
        i_layer = layer_of(name)  # a MoE's layer comes from the name, n_layer from the hparams
        if i_layer < 0 or i_layer >= n_layer:
            raise MoestreamError(f"tensor {name} is outside the model's {n_layer} layers")
        if quant in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, n_layer):
            new = "Q6_K"
    elif cat == "attn_output" and n_expert == 8 and quant == "Q4_K_M":
        new = "Q5_K"
    return new


def _fallback(ncols: int, chosen: str) -> str:
    """tensor_type_fallback: a compatible type when the row length is not a multiple of the block."""
    if ncols % block_size(chosen) == 0:
        return chosen
    out = _FALLBACK.get(chosen, chosen)
    return out if ncols % block_size(out) == 0 else "F16"
