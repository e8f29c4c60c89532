"""GGUF names and metadata of a synthetic model, as llama.cpp's converter and llama-quantize write them.

Tensor names come from the `gguf` package's own TensorNameMap (the table the converter uses), with
per-expert HF tensors named as the converter names them after stacking
(`model.layers.N.mlp.experts.gate_proj.weight` -> `blk.N.ffn_gate_exps.weight`). Metadata follows
`TextModel.set_gguf_parameters` (hparams looked up under the same config keys), `_set_vocab_gpt2`
(tokens, token types, merges and special ids through `gguf.SpecialVocab`) and llama-quantize
(`general.file_type`, `general.quantization_version`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from moestream.errors import MoestreamError
from moestream.synth.shapes import SynthSpec, with_attention_shape

# moestream model_type -> llama.cpp architecture; other families are not written as GGUF (yet)
GGUF_ARCHS: dict[str, gguf.MODEL_ARCH] = {
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
}
# the synthetic tokenizer splits like GPT-2 (ByteLevel with GPT-2's regex): llama.cpp's "gpt-2"
PRE_TOKENIZER = "gpt-2"
SYNTH_KEY = "moestream.synth"


def arch_of(model_type: str) -> gguf.MODEL_ARCH:
    """llama.cpp's architecture for a synth arch; one clear error for the ones not written as GGUF."""
    if model_type not in GGUF_ARCHS:
        raise MoestreamError(
            f"--format gguf writes {', '.join(GGUF_ARCHS)} models; {model_type} is not supported yet"
        )
    return GGUF_ARCHS[model_type]


def check_loadable(spec: SynthSpec) -> None:
    """Refuse shapes llama.cpp cannot load although its converter writes them (one clear sentence)."""
    arch_of(spec.arch)
    s = with_attention_shape(spec)
    if spec.arch == "olmoe" and s.kv_heads != s.heads:
        raise MoestreamError(
            f"llama.cpp's olmoe normalises keys over all attention heads and needs as many kv heads as "
            f"heads; this shape has {s.heads} heads and {s.kv_heads} kv heads "
            "(--preset olmoe-1b-7b has 16 and 16)"
        )


class Names:
    """HF checkpoint names -> GGUF tensor names for one architecture and layer count."""

    def __init__(self, model_type: str, n_layers: int) -> None:
        self._map = gguf.get_tensor_name_map(arch_of(model_type), n_layers)

    def of(self, hf_name: str) -> str:
        """The GGUF name of a non-expert tensor or of a stacked expert tensor."""
        name = self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise MoestreamError(f"no GGUF name for checkpoint tensor {hf_name}")
        return name

    def experts(self, layer: int, proj: str) -> str:
        """The GGUF name of layer `layer`'s stacked `proj` ("gate_proj", "up_proj", "down_proj")."""
        return self.of(f"model.layers.{layer}.mlp.experts.{proj}.weight")


def _find(hparams: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((hparams[k] for k in keys if hparams.get(k) is not None), None)


def add_hparams(w: gguf.GGUFWriter, model_type: str, hparams: dict[str, Any], file_type: int) -> None:
    """What the converter's `set_gguf_parameters` writes for `model_type`, from the config.json dict:
    TextModel's keys, then the family's own (Qwen2MoeModel: expert widths; OlmoeModel: rms eps 1e-5)."""
    w.add_block_count(hparams["num_hidden_layers"])
    w.add_context_length(_find(hparams, ("max_position_embeddings", "n_ctx", "n_positions")))
    w.add_embedding_length(hparams["hidden_size"])
    w.add_feed_forward_length(_find(hparams, ("intermediate_size", "n_inner", "hidden_dim")))
    w.add_head_count(hparams["num_attention_heads"])
    w.add_head_count_kv(hparams["num_key_value_heads"])
    rope = hparams.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise MoestreamError(f"RoPE scaling {rope.get('rope_type')!r} is not written to GGUF yet")
    theta = rope.get("rope_theta", hparams.get("rope_theta"))
    if theta is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5 if model_type == "olmoe" else hparams["rms_norm_eps"])
    w.add_expert_count(_find(hparams, ("num_local_experts", "num_experts", "n_routed_experts")))
    w.add_expert_used_count(hparams["num_experts_per_tok"])
    if hparams.get("head_dim") is not None:
        w.add_key_length(hparams["head_dim"])
        w.add_value_length(hparams["head_dim"])
    w.add_file_type(file_type)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_feed_forward_length(hparams["moe_intermediate_size"])
    if hparams.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(hparams["shared_expert_intermediate_size"])


def vocab_entries(tok_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and token types as the converter's get_vocab_base lists them (unused ids padded)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    reverse = {i: t for t, i in tok.vocab.items()}
    if max(reverse) >= vocab_size:
        raise MoestreamError(
            f"the tokenizer has ids up to {max(reverse)}, beyond the vocab size {vocab_size}"
        )
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token not in added:
            types.append(gguf.TokenType.NORMAL)
        else:
            if not decoder[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            special = decoder[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        tokens.append(token)
    return tokens, types


def add_vocab(w: gguf.GGUFWriter, tok_dir: Path, vocab_size: int) -> None:
    """`_set_vocab_gpt2`: the byte-level BPE with merges, special ids and the chat template."""
    tokens, types = vocab_entries(tok_dir, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(tok_dir, load_merges=True)
    post = json.loads((tok_dir / "tokenizer.json").read_text()).get("post_processor") or {}
    if post.get("type") == "ByteLevel":
        # a ByteLevel post-processor adds no bos/eos: newer gguf-py (llama.cpp's own) writes so explicitly
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(w, quiet=True)


def add_general(w: gguf.GGUFWriter, name: str, size_label: str, marker: dict[str, Any]) -> None:
    """general.type/name/size_label like the converter, and moestream's synth marker as JSON."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    if size_label:
        w.add_size_label(size_label)
    w.add_string(SYNTH_KEY, json.dumps(marker, separators=(",", ":")))


def read_synth_marker(path: str | Path) -> dict[str, Any] | None:
    """The synth marker of a GGUF written by `moestream synth`, or None for any other GGUF."""
    reader = gguf.GGUFReader(str(path))
    field = reader.get_field(SYNTH_KEY)
    if field is None:
        return None
    return json.loads(field.contents())
