"""Weight formats are one class each: a toy format registered by this test alone streams exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as T
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny

import moestream
from moestream.runtime import formats
from moestream.runtime.formats import WeightFormat

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250]


class Fp16Upcast(WeightFormat):
    """Toy: fp16 on disk, upcast to fp32 on every read (a copy), then a plain F.linear."""

    name = "fp16-upcast"
    views = 0

    def view(self, raws: list[torch.Tensor]) -> torch.Tensor:
        Fp16Upcast.views += 1
        return raws[0].view(torch.float16).view(self.shapes[0]).float()

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


def _fp16_experts(path):
    """Rewrite a tiny checkpoint's expert tensors in fp16 (the rest stays fp32)."""
    sd = load_file(path / "model.safetensors")
    sd = {k: (v.half() if ".experts." in k else v) for k, v in sd.items()}
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def test_a_registered_toy_format_streams_exactly(tmp_path):
    path = write_tiny("qwen3_moe", tmp_path / "m", experts=8, top_k=2)
    _fp16_experts(path)
    stock = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # upcasts at load
    ref = stock.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with torch.inference_mode():
        ref_logits = stock(ref).logits[0]
    previous = formats.register("F16", Fp16Upcast)
    try:
        with moestream.load(str(path), cache="200KiB", dtype="float32") as engine:
            assert {type(f) for f in engine.runtime.formats.values()} == {Fp16Upcast}
            gen = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
            with torch.inference_mode():
                logits = engine.model(ref).logits[0]
            assert engine.cache.stats.misses > len(engine.emap.units)  # streamed, not all resident
    finally:
        formats.unregister("F16", previous)
    assert Fp16Upcast.views > 0
    assert gen.tokens == ref[0, len(PROMPT) :].tolist()
    assert (logits - ref_logits).abs().max().item() <= 1e-5


def test_unknown_stored_type_is_one_clear_error(tmp_path):
    import pytest

    from moestream.errors import UnsupportedModelError

    path = write_tiny("qwen3_moe", tmp_path / "m", experts=8, top_k=2)
    sd = load_file(path / "model.safetensors")
    sd = {k: ((v * 100).to(torch.int16) if ".experts." in k else v) for k, v in sd.items()}
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="experts stored as I16 are not supported"):
        moestream.load(str(path), cache="200KiB")
