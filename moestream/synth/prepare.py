"""What both synth writers (safetensors, GGUF) start from: tokenizer and configs on disk, the meta model,
and the checkpoint tensors in file order with the init scheme and noise source of their values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.errors import MoestreamError
from moestream.synth.configs import build_config
from moestream.synth.layout import TensorSpec, checkpoint_tensors
from moestream.synth.noise import NoiseSource
from moestream.synth.shapes import DTYPES, SynthSpec
from moestream.synth.tokenizer import DEFAULT_VOCAB, save_tokenizer
from moestream.synth.weights import InitScheme
from moestream.units import round_up


@dataclass(frozen=True)
class Prepared:
    """What both writers need: the config, the meta model, the checkpoint tensors in file order, and
    the init scheme and noise source their values come from."""

    spec: SynthSpec
    cfg: Any
    model: Any
    specs: list[TensorSpec]
    scheme: InitScheme
    source: NoiseSource
    vocab: int
    tokenizer_size: int


def prepare(tmp: Path, spec: SynthSpec) -> Prepared:
    """Write the tokenizer, config.json and generation_config.json into `tmp`; plan the tensors."""
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
    return Prepared(spec, cfg, model, specs, scheme, NoiseSource(spec.seed), vocab, tok["size"])


def meta_model(cfg: Any, dtype: str = "bf16") -> Any:
    """The transformers CausalLM of `cfg` on the meta device: names, shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # the class imported first, outside the meta device: torch 2.6 cannot import torch._dynamo (which
    # the modeling modules import) under it ("Tensor.item() cannot be called on meta tensors")
    MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPES[dtype]))


def _save_generation_config(tmp: Path, eos_ids: list[int], pad_id: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id).save_pretrained(str(tmp))
