"""Initial values: the realistic-routing scales, transformers' own init for small tensors, and the routing
they give."""

from __future__ import annotations

import pytest
import torch

from moestream.synth.build import synthesize
from moestream.synth.routing import SAMPLE_TEXT, routing_stats
from moestream.synth.weights import InitScheme

SMALL = dict(experts=32, top_k=4, hidden=256, moe_intermediate=32, dtype="fp32")


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(
        path
    )


def test_scheme_scales():
    s = InitScheme()
    assert s.std_for("embed") == pytest.approx(0.4) and s.std_for("out") == pytest.approx(0.0004)
    assert s.std_for("down") == pytest.approx(0.0004) and s.std_for("matrix") == 0.02
    assert InitScheme.plain().std_for("embed") == 0.02 and InitScheme.plain().std_for("down") == 0.02


@pytest.mark.parametrize("realistic", [True, False])
def test_weight_statistics(realistic, tmp_path):
    out = synthesize(tmp_path / "m", arch="qwen2_moe", layers=2, realistic_routing=realistic, **SMALL)
    model, _ = _load(out)
    layer = model.model.layers[1]
    emb, out_s = (20.0, 0.02) if realistic else (1.0, 1.0)
    checks = {
        "embed": (model.model.embed_tokens.weight, 0.02 * emb),
        "q_proj": (layer.self_attn.q_proj.weight, 0.02),
        "o_proj": (layer.self_attn.o_proj.weight, 0.02 * out_s),
        "router": (layer.mlp.gate.weight, 0.02),
        "experts.gate_up": (layer.mlp.experts.gate_up_proj, 0.02),
        "experts.down": (layer.mlp.experts.down_proj, 0.02 * out_s),
        "shared.down": (layer.mlp.shared_expert.down_proj.weight, 0.02 * out_s),
        "lm_head": (model.lm_head.weight, 0.02),
    }
    for name, (w, std) in checks.items():
        assert w.std().item() == pytest.approx(std, rel=0.1), name
        assert abs(w.mean().item()) < 0.1 * std, name
    assert torch.all(layer.input_layernorm.weight == 1.0)
    assert torch.all(layer.self_attn.q_proj.bias == 0.0)


def test_small_tensors_follow_transformers_init(tmp_path):
    out = synthesize(tmp_path / "next", arch="qwen3_next", layers=4, **SMALL)
    model, _ = _load(out)
    linear = model.model.layers[0].linear_attn
    assert torch.all(model.model.layers[0].input_layernorm.weight == 0.0)  # (1 + w) norms are zero-centred
    assert torch.all(linear.norm.weight == 1.0)
    assert torch.all(linear.dt_bias == 1.0)
    a = linear.A_log.exp()
    assert torch.all((a >= 0.009) & (a <= 16.1)) and a.unique().numel() > 1  # uniform(0.01, 16), logged
    assert linear.conv1d.weight.std() > 0


def test_realistic_init_routes_flat_plain_init_collapses(tmp_path):
    """The reason for the scales: plain init sends deep-layer tokens to a few experts."""
    stats = {}
    for realistic in (True, False):
        out = synthesize(
            tmp_path / str(realistic), arch="qwen3_moe", layers=6, realistic_routing=realistic, **SMALL
        )
        stats[realistic] = routing_stats(*_load(out), SAMPLE_TEXT, max_tokens=300)
    flat = [row["hot8_share"] for row in stats[True]["layers"]]
    assert max(flat) < 0.5 and stats[True]["adjacent_overlap"] < 0.25  # uniform: 8/32 and 4/32
    deep = stats[False]["layers"][-1]
    assert deep["hot8_share"] > 0.8 and deep["adjacent_overlap"] > 0.6
