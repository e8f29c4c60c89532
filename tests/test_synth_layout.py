"""synth checkpoints of every architecture: on-disk names match transformers, which loads them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moestream.synth.build import SYNTH_MARKER, meta_model, synthesize
from moestream.synth.configs import build_config
from moestream.synth.layout import checkpoint_tensors
from moestream.synth.shapes import ARCHS, resolve_spec

TINY = dict(experts=8, top_k=2, hidden=64, moe_intermediate=32)


def _layers(arch: str) -> int:
    # Qwen3-Next / Qwen3.5 put full attention on every 4th layer: 4 layers cover both kinds
    return 4 if arch in ("qwen3_next", "qwen3_5_moe") else 2


def _disk(path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of every safetensors file in a checkpoint directory."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = st.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


@pytest.fixture(scope="module")
def synths(tmp_path_factory):
    """{arch: directory} of a tiny fp32 synth per architecture (written once for the module)."""
    root = tmp_path_factory.mktemp("synth-archs")
    return {
        arch: synthesize(root / arch, arch=arch, layers=_layers(arch), dtype="fp32", **TINY) for arch in ARCHS
    }


def _save_pretrained_keys(arch: str, tmp_path) -> dict[str, tuple[tuple[int, ...], str]]:
    """What transformers' own save_pretrained writes for the same config (reverse weight conversion)."""
    from transformers import AutoModelForCausalLM

    spec = resolve_spec(arch=arch, layers=_layers(arch), dtype="fp32", **TINY)
    cfg = build_config(spec, vocab_size=1024, eos_id=0, pad_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(tmp_path / "ref")
    return _disk(tmp_path / "ref")


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen3_5_moe"])
def test_layout_matches_save_pretrained(arch, synths, tmp_path):
    ours = _disk(synths[arch])
    ref = _save_pretrained_keys(arch, tmp_path)
    # e_score_correction_bias is fp32 on disk in the real DeepSeek-V3/GLM checkpoints, and so in ours
    assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in ref.items()}


def test_qwen3_5_layout_is_fused_under_language_model(synths, tmp_path):
    ours = _disk(synths["qwen3_5_moe"])
    ref = _save_pretrained_keys("qwen3_5_moe", tmp_path)  # per expert, without the VLM prefix
    E, H, I = TINY["experts"], TINY["hidden"], TINY["moe_intermediate"]
    expected = {}
    for k, (shape, _) in ref.items():
        k = "model.language_model." + k[len("model.") :] if k.startswith("model.") else k
        if ".mlp.experts." in k:
            prefix = k.split(".mlp.experts.")[0] + ".mlp.experts."
            expected[prefix + "gate_up_proj"] = (E, 2 * I, H)
            expected[prefix + "down_proj"] = (E, H, I)
        else:
            expected[k] = shape
    assert {k: v[0] for k, v in ours.items()} == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_stock_transformers_loads_and_generates(arch, synths):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        synths[arch], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not any(p.is_meta for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(synths[arch])
    ids = tok("The orchard opens at nine.", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_loaded_experts_are_the_disk_bytes_gate_first(synths):
    """transformers fuses gate_proj (w1) before up_proj (w3): its experts are our per-expert tensors."""
    from transformers import AutoModelForCausalLM

    I = TINY["moe_intermediate"]
    for arch, names in (
        ("qwen3_moe", ("mlp", "gate_proj", "up_proj", "down_proj")),
        ("mixtral", ("block_sparse_moe", "w1", "w3", "w2")),
    ):
        model = AutoModelForCausalLM.from_pretrained(synths[arch], dtype=torch.float32)
        experts = model.model.layers[1].mlp.experts
        block, gate, up, down = names
        with safe_open(str(synths[arch] / "model.safetensors"), "pt") as st:
            for e in (0, 5):
                p = f"model.layers.1.{block}.experts.{e}."
                assert torch.equal(experts.gate_up_proj[e, :I], st.get_tensor(p + gate + ".weight"))
                assert torch.equal(experts.gate_up_proj[e, I:], st.get_tensor(p + up + ".weight"))
                assert torch.equal(experts.down_proj[e], st.get_tensor(p + down + ".weight"))


def test_config_and_marker(synths):
    from transformers import AutoConfig

    raw = json.loads((synths["qwen3_moe"] / "config.json").read_text())
    assert raw["model_type"] == "qwen3_moe" and raw["dtype"] == "float32"
    cfg = AutoConfig.from_pretrained(synths["qwen3_moe"])
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2 and cfg.moe_intermediate_size == 32
    assert cfg.vocab_size >= 1000 and cfg.tie_word_embeddings is False
    marker = json.loads((synths["qwen3_moe"] / SYNTH_MARKER).read_text())
    assert marker["synthetic"] is True and marker["arch"] == "qwen3_moe" and marker["moe_layers"] == 2
    assert marker["expert_bytes"] == 2 * 8 * 3 * 64 * 32 * 4
    composite = json.loads((synths["qwen3_5_moe"] / "config.json").read_text())
    assert composite["model_type"] == "qwen3_5_moe" and composite["text_config"]["num_experts"] == 8


def test_dense_first_layer_has_no_experts(synths):
    marker = json.loads((synths["deepseek_v3"] / SYNTH_MARKER).read_text())
    assert marker["moe_layers"] == 1  # first_k_dense_replace = 1, like the real DeepSeek/GLM checkpoints
    disk = _disk(synths["deepseek_v3"])
    assert disk["model.layers.1.mlp.gate.e_score_correction_bias"] == ((8,), "F32")
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in disk)


def test_gpt_oss_mxfp4_layout_and_dequantized_scale(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = synthesize(
        tmp_path / "mx",
        arch="gpt_oss",
        layers=2,
        experts=4,
        top_k=2,
        hidden=64,
        moe_intermediate=64,
        mxfp4=True,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    disk = _disk(out)
    p = "model.layers.0.mlp.experts."
    assert disk[p + "gate_up_proj_blocks"] == ((4, 128, 2, 16), "U8")
    assert disk[p + "gate_up_proj_scales"] == ((4, 128, 2), "U8")
    assert disk[p + "down_proj_blocks"] == ((4, 64, 2, 16), "U8")
    assert disk[p + "down_proj_scales"] == ((4, 64, 2), "U8")
    assert disk[p + "gate_up_proj_bias"] == ((4, 128), "BF16") and disk[p + "down_proj_bias"] == (
        (4, 64),
        "BF16",
    )
    assert p + "gate_up_proj" not in disk
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        w = convert_moe_packed_tensors(
            st.get_tensor(p + "gate_up_proj_blocks"),
            st.get_tensor(p + "gate_up_proj_scales"),
            dtype=torch.float32,
        )
        d = convert_moe_packed_tensors(
            st.get_tensor(p + "down_proj_blocks"), st.get_tensor(p + "down_proj_scales"), dtype=torch.float32
        )
    assert w.shape == (4, 64, 128) and d.shape == (4, 64, 64)  # [E, in, out] like the bf16 parameters
    assert 0.01 < w.std().item() < 0.04  # target N(0, 0.02)
    assert 0.0002 < d.std().item() < 0.0008  # down projections x0.02


def test_meta_model_is_free():
    spec = resolve_spec(preset="qwen3-30b-a3b")
    model = meta_model(build_config(spec, vocab_size=151936, eos_id=0, pad_id=0), "bf16")
    specs = checkpoint_tensors(model, "qwen3_moe", "bf16", experts=128, hidden=2048, moe_intermediate=768)
    experts = [s for s in specs if s.routed]
    assert len(experts) == 48 * 128 * 3
    assert sum(s.nbytes for s in experts) == 48 * 128 * 3 * 2048 * 768 * 2  # 54 GiB, never allocated


def test_gpt_oss_mxfp4_loads_in_stock_transformers(tmp_path):
    """transformers reads the synthetic's MXFP4 blocks and scales through its own dequantizing path (no
    hub: since 5.25, without `dequantize=True` its CPU path fetches a Triton kernel from the hub)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, Mxfp4Config

    out = synthesize(
        tmp_path / "mx",
        arch="gpt_oss",
        layers=2,
        experts=8,
        top_k=2,
        hidden=64,
        moe_intermediate=64,
        mxfp4=True,
    )
    model, info = AutoModelForCausalLM.from_pretrained(
        out,
        dtype=torch.float32,
        output_loading_info=True,
        quantization_config=Mxfp4Config(dequantize=True),
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 128)
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
