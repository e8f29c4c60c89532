"""Router traces with predictions on every checkpoint dtype, through every trunk, for every family.

A bf16 checkpoint (the hub's most common) traced through the ggml graphs exited with a dtype error: the
graphs hand on float32 rows and the trace's two-layers-ahead prediction called the bf16 router on them.
Here each family's tiny checkpoint, stored in bf16 and in float16, records a trace with the stale-gate
predictions (`--trace`, predictions on by default) through each trunk, and `simulate` replays it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import ARCHS, tiny_config, write_tiny

from moestream.cli import main
from moestream.trace import PHASES, read_trace

pytest.importorskip("pyarrow")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TRUNKS = ["ggml", "eager"] + (["graphs"] if torch.cuda.is_available() else [])


# the trace predicts one and two MoE layers ahead: at least three MoE layers (DeepSeek's first is dense)
LAYERS = 4


def _deeper(arch: str) -> dict:
    """Overrides giving the tiny `arch` LAYERS layers, its per-layer pattern (linear/full attention,
    sliding/full) repeated."""
    config = tiny_config(arch.removesuffix("_mxfp4"))
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    extra = {"num_hidden_layers": LAYERS}
    types = getattr(config, "layer_types", None)
    if types:
        extra["layer_types"] = [types[i % len(types)] for i in range(LAYERS)]
    return extra


@pytest.fixture(scope="module")
def stored_as(tmp_path_factory):
    """stored_as(arch, dtype) -> the tiny checkpoint with every float tensor (MXFP4 blocks and scales
    stay bytes) stored in `dtype`, and config.json saying so, as a checkpoint saved in that dtype is."""
    made = {}

    def make(arch: str, dtype: str):
        if (arch, dtype) not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            write_tiny(arch, out, **_deeper(arch))
            for path in out.glob("*.safetensors"):
                sd = load_file(path)
                sd = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in sd.items()}
                save_file(sd, path, metadata={"format": "pt"})
            config = json.loads((out / "config.json").read_text())
            config["dtype"] = dtype
            for sub in ("text_config",):
                if isinstance(config.get(sub), dict):
                    config[sub]["dtype"] = dtype
            (out / "config.json").write_text(json.dumps(config, indent=2))
            made[(arch, dtype)] = out
        return made[(arch, dtype)]

    return make


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_trace_with_predictions_records_and_simulates(stored_as, arch, dtype, tmp_path, capsys):
    path = stored_as(arch, dtype)
    for trunk in TRUNKS:
        trace = tmp_path / f"{trunk}.parquet"
        argv = ["generate", str(path), "-p", "hello world", "-n", "4", "--cache", "1MiB", "--json"]
        assert main([*argv, "--trunk", trunk, "--trace", str(trace)]) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert len(out["tokens"]) == 4
        t = read_trace(trace)
        assert t.pred_experts is not None, (trunk, "no predictions recorded")
        # every MoE layer but the last predicts the next one's experts: its rows carry 2k guesses
        last = max(t.layer.tolist())
        predicted = t.pred_experts[t.layer != last]
        assert len(predicted) and (predicted[:, : 2 * t.header.top_k] >= 0).all(), trunk
        sim_argv = ["simulate", str(trace), "--budgets", "64KiB,1MiB", "--policy", "lru", "lru-prefetch"]
        assert main([*sim_argv, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        decode = [r for r in rows if r["phase"] == "decode" and r["scope"] == "all"]
        assert {r["policy"] for r in decode} == {"lru", "lru-prefetch"}, trunk
        picks = int((t.experts[t.phase == PHASES.index("decode")] >= 0).sum())  # k distinct a decode row
        assert all(r["hits"] + r["misses"] == picks for r in decode if r["policy"] == "lru"), trunk
