"""Expert tensors are checked against the config at load: dtype and shape of every part of every expert.

The oracle for "right" is transformers' own checkpoint of each architecture (tiny_models.write_tiny): every
one must pass. The wrong ones are real checkpoints with one tensor changed, refused before any token.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import ARCHS

from moestream.cli import main
from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.model.arch import arch_for, num_experts
from moestream.runtime.checks import check_experts
from moestream.store.source import open_source


def _emap(ckpt: Path):
    source = open_source(ckpt)
    config = source.config()
    return source.expert_map(arch_for(config).family, num_experts(config)), config


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_as_transformers_writes_it_passes(tiny_dir, arch):
    emap, config = _emap(tiny_dir(arch))
    check_experts(emap, config)  # raises on any disagreement
    assert emap.units


def _replace_part(emap, kind: str, **changes):
    key = sorted(emap.units)[-1]
    parts = emap.units[key][kind]
    emap.units[key][kind] = (dataclasses.replace(parts[0], **changes), *parts[1:])
    return parts[0].name


@pytest.mark.parametrize(
    "arch, kind, changes, message",
    [
        (
            "qwen3_moe",
            "down",
            {"shape": (32, 64)},
            "has shape [32, 64], but config.json (hidden_size 64, expert "
            "intermediate size 32) implies [64, 32]",
        ),
        (
            "qwen3_moe",
            "gate",
            {"dtype": "I32"},
            "has dtype I32; the experts of its layer are stored as F32, so it must be too",
        ),
        ("mixtral", "up", {"shape": (32, 65)}, "implies [32, 64]"),
        ("qwen3_5_moe", "up", {"shape": (16, 64)}, "implies [32, 64]"),
        ("gpt_oss", "gate_up", {"shape": (128, 64)}, "implies [64, 128]"),
        (
            "gpt_oss_mxfp4",
            "down",
            {"dtype": "BF16"},
            "has dtype BF16; the experts of its layer are stored as U8",
        ),
        ("gpt_oss_mxfp4", "gate_up", {"shape": (128, 4, 16)}, "implies [128, 2, 16]"),
    ],
)
def test_a_part_that_disagrees_with_the_config_is_named(tiny_dir, arch, kind, changes, message):
    emap, config = _emap(tiny_dir(arch))
    name = _replace_part(emap, kind, **changes)
    with pytest.raises(CheckpointError, match="tensor") as info:
        check_experts(emap, config)
    assert name in str(info.value) and message in str(info.value)


def test_a_bias_that_disagrees_with_the_config_is_named(tiny_dir):
    emap, config = _emap(tiny_dir("gpt_oss"))
    key = sorted(emap.resident)[0]
    emap.resident[key] = dataclasses.replace(emap.resident[key], shape=(8, 7))
    with pytest.raises(CheckpointError, match=r"has shape \[8, 7\]"):
        check_experts(emap, config)


def _mutated(src: Path, dst: Path, name: str, change) -> Path:
    shutil.copytree(src, dst)
    shard = next(dst.glob("*.safetensors"))
    sd = load_file(shard)
    sd[name] = change(sd[name]).contiguous()
    save_file(sd, shard, metadata={"format": "pt"})
    return dst


PER_EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
FUSED = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    "arch, name, change, message",
    [
        ("qwen3_moe", PER_EXPERT, lambda t: t.to(torch.int32), "has dtype I32"),
        ("qwen3_moe", PER_EXPERT, lambda t: t[:16], "has shape [16, 64]"),
        ("qwen3_moe", PER_EXPERT, lambda t: t.T, "has shape [64, 32]"),
        ("gpt_oss", FUSED, lambda t: t[:6], "has shape [6, 64, 128], which holds no row for expert 6"),
        ("gpt_oss", FUSED, lambda t: t.transpose(1, 2), "has shape [128, 64]"),
    ],
)
def test_generate_refuses_a_bad_expert_before_any_token(
    capsys, tiny_dir, tmp_path, arch, name, change, message
):
    """Before the check: an int32 or a short expert gave exit 0 and plausible text, a transposed one a
    traceback at its first use."""
    ckpt = _mutated(tiny_dir(arch), tmp_path / "bad", name, change)
    code = main(["generate", str(ckpt), "--prompt", "Hello there", "--max-tokens", "3"])
    out = capsys.readouterr()
    assert code == 2 and "Traceback" not in out.err and out.out == ""
    assert name in out.err and message in out.err


def test_an_expert_in_another_float_type_than_its_layer_is_refused(capsys, tiny_dir, tmp_path):
    """One format serves a whole (layer, kind): a bf16 expert among float32 ones would be read as float32."""
    ckpt = _mutated(tiny_dir("qwen3_moe"), tmp_path / "bf16", PER_EXPERT, lambda t: t.to(torch.bfloat16))
    assert main(["generate", str(ckpt), "--prompt", "Hello there", "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert f"tensor {PER_EXPERT}" in err and "has dtype BF16" in err and "stored as F32" in err


def test_a_layer_stored_in_a_type_no_format_computes_names_its_tensor(tiny_dir):
    emap, config = _emap(tiny_dir("qwen3_moe"))
    layer = emap.layers[0]
    ref = emap.units[(layer, 0)]["gate"][0]
    emap.units[(layer, 0)]["gate"] = (dataclasses.replace(ref, dtype="I32"),)
    emap.formats[(layer, "gate")] = dataclasses.replace(emap.formats[(layer, "gate")], name="I32")
    with pytest.raises(UnsupportedModelError, match=f"tensor {re.escape(ref.name)} in .*stored as I32"):
        check_experts(emap, config)
