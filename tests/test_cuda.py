"""CUDA path (run on the GPU machine; skipped without a GPU): streamed vs stock transformers on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as T

import moestream
from moestream.cache.size_classes import budget_requirements

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.usefixtures("torch_cuda_path"),  # the torch CUDA path's tests (engine/gpu_path.py)
]

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250]
ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3_5_moe", "gpt_oss", "gpt_oss_mxfp4"]


def _bf16_reference(path, arch):
    extra = {"quantization_config": T.Mxfp4Config(dequantize=True)} if arch.endswith("mxfp4") else {}
    model = (
        T.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation="eager", **extra
        )
        .cuda()
        .eval()
    )
    out = model.generate(
        torch.tensor([PROMPT], device="cuda"), max_new_tokens=32, min_new_tokens=32, do_sample=False
    )
    with torch.inference_mode():
        logits = model(out).logits[0].float()
    return out, logits


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_streamed_equals_stock(arch, tiny_dir):
    path = tiny_dir(arch)
    ids, ref_logits = _bf16_reference(path, arch)
    with moestream.load(str(path), device="cuda", cache="64MiB", dtype="bfloat16") as engine:
        _minimum, _ = budget_requirements(engine.emap, engine.top_k)
        everything = engine.runtime.tier.slot_bytes * len(engine.emap.units)
        for gpu_cache, host_cache in (
            (engine.runtime.tier.slot_bytes * engine.top_k, 0),
            (everything // 2, 0),
            (everything // 2, "64MiB"),
            (everything, "64MiB"),
        ):
            engine.restream(gpu_cache=gpu_cache, host_cache=host_cache)
            gen = engine.generate(PROMPT, max_tokens=32, ignore_eos=True)
            assert gen.tokens == ids[0, len(PROMPT) :].tolist(), (arch, gpu_cache, host_cache)
            with torch.inference_mode():
                logits = engine.model(ids).logits[0].float()
            assert (logits - ref_logits).abs().max().item() <= 2e-2, (arch, gpu_cache, host_cache)


def test_one_host_sync_per_layer(tiny_dir):
    """CUDA sync debug mode flags every synchronising op; in moestream code only the routing readback."""
    path = tiny_dir("qwen3_moe")
    with moestream.load(
        str(path), device="cuda", cache="64MiB", gpu_cache="100KiB", host_cache="64MiB", dtype="bfloat16"
    ) as engine:
        engine.generate(PROMPT, max_tokens=4, ignore_eos=True)  # warm up
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.inference_mode():
                    engine.model(torch.tensor([[5]], device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ours = [w for w in caught if "moestream" in w.filename]
        layers = len(engine.emap.layers)
        assert len(ours) == layers, [(w.filename, w.lineno) for w in ours]
        assert all(w.filename.endswith("runtime/experts.py") for w in ours)
        assert engine.runtime.tier.stats.host_syncs == 0


def test_gpu_eviction_falls_back_to_the_host_tier(tiny_dir):
    path = tiny_dir("qwen3_moe")
    with moestream.load(
        str(path), device="cuda", cache="64MiB", gpu_cache="100KiB", host_cache="64MiB", dtype="bfloat16"
    ) as engine:
        first = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
        read = engine.reader.bytes_read
        second = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
        assert second.tokens == first.tokens
        assert engine.reader.bytes_read == read  # every expert came from pinned host memory
        assert engine.runtime.tier.stats.gpu_misses > 0  # while the small GPU tier kept evicting


def test_unified_memory_tier_matches_stock(tiny_dir):
    """--unified (automatic on Jetson): kernels read the pinned, device-mapped slots in place."""
    path = tiny_dir("qwen3_moe")
    ids, ref_logits = _bf16_reference(path, "qwen3_moe")
    with moestream.load(str(path), device="cuda", cache="100KiB", unified=True, dtype="bfloat16") as engine:
        assert "unified memory" in engine.mode_line()
        gen = engine.generate(PROMPT, max_tokens=32, ignore_eos=True)
        assert gen.tokens == ids[0, len(PROMPT) :].tolist()
        with torch.inference_mode():
            logits = engine.model(ids).logits[0].float()
        assert (logits - ref_logits).abs().max().item() <= 2e-2
        assert engine.cache.stats.misses > len(engine.emap.units)  # 100 KiB: experts are re-read all the time
