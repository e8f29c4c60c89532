"""`moestream synth --format gguf`: the file parses, names/types/metadata are llama.cpp's, and it holds
the same model as the safetensors synth of the same arguments (checked with the gguf package's own
dequantization, an implementation independent of ggml)."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_synth_gguf_mix import expected

from moestream.cli import main
from moestream.synth import synthesize
from moestream.synth.layout import checkpoint_tensors
from moestream.synth.noise import NoiseSource
from moestream.synth.tokenizer import CHAT_TEMPLATE
from moestream.synth.weights import InitScheme, chunks_for, first_chunks

# relative RMS error of each type on N(0, s) weights, measured once with ggml's quantizer and
# gguf.quants.dequantize, x1.25 (the larger of s = .02 and s = .0004, the synthetic down projections,
# whose fp16 super-block scales are subnormal): Q4_K .073, Q5_K .039, Q6_K .028, Q8_0 .0058,
# MXFP4 .118, Q5_0 .043
REL_RMS = {"Q4_K": 0.091, "Q5_K": 0.049, "Q6_K": 0.035, "Q8_0": 0.0073, "MXFP4": 0.147, "Q5_0": 0.054}
SHAPE = dict(arch="qwen3_moe", top_k=2, hidden=256, moe_intermediate=256, seed=3)
# HF names of the non-expert tensors of layer {i}, written out independently of gguf's name table
LAYER_NAMES = {
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
}
# Qwen2-MoE: q/k/v biases and a gated shared expert, no q/k norms
QWEN2_NAMES = {
    **{
        k: v
        for k, v in LAYER_NAMES.items()
        if "_norm.weight" not in k or k in ("attn_norm.weight", "ffn_norm.weight")
    },
    **{f"attn_{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"},
    **{
        f"ffn_{p}_shexp.weight": f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight"
        for p in ("gate", "up", "down")
    },
    "ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
ARCH_NAMES = {"qwen3_moe": LAYER_NAMES, "olmoe": LAYER_NAMES, "qwen2_moe": QWEN2_NAMES}
TOP_NAMES = {
    "token_embd": "model.embed_tokens.weight",
    "output_norm": "model.norm.weight",
    "output": "lm_head.weight",
}
EXPERT_PROJ = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

# (arch, quant, layers, experts, moe_intermediate): the mixes, 8 experts (llama.cpp's 8-expert rules),
# an expert width that is not a multiple of 256 (the Q4_K -> Q5_0 and Q6_K -> Q8_0 fallbacks), and
# the other two families written as GGUF (OLMoE at its preset's attention: llama.cpp needs 16/16 heads)
CASES = [
    ("qwen3_moe", "Q4_K_M", 8, 16, 256),
    ("qwen3_moe", "Q5_K_M", 4, 8, 256),
    ("qwen3_moe", "Q8_0", 2, 8, 256),
    ("qwen3_moe", "MXFP4_MOE", 2, 16, 256),
    ("qwen3_moe", "BF16", 2, 8, 256),
    ("qwen3_moe", "Q4_K_M", 2, 8, 96),
    ("qwen2_moe", "Q4_K_M", 2, 16, 256),
    ("olmoe", "Q5_K_M", 1, 8, 256),
]
IDS = ["-".join(map(str, c)) for c in CASES]


def synth_args(arch: str, layers: int, experts: int, inter: int) -> dict:
    base = dict(preset="olmoe-1b-7b", top_k=2, seed=3) if arch == "olmoe" else dict(SHAPE, arch=arch)
    return dict(base, layers=layers, experts=experts, moe_intermediate=inter)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """For each case: the GGUF and the safetensors synth of the same arguments, loaded."""
    root = tmp_path_factory.mktemp("synth_gguf")
    out = {}
    for case in CASES:
        arch, quant, *shape = case
        ref = root / "st-{}-{}-{}-{}".format(arch, *shape)
        if not ref.exists():
            synthesize(ref, **synth_args(arch, *shape))
        path = root / ("-".join(map(str, case)) + ".gguf")
        synthesize(path, format="gguf", quant=quant, threads=2, **synth_args(arch, *shape))
        out[case] = (gguf.GGUFReader(str(path)), load_file(str(ref / "model.safetensors")), path)
    return out


def field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


def hf_reference(name: str, sd: dict[str, torch.Tensor], arch: str, experts: int) -> np.ndarray:
    """The safetensors synth's values of a GGUF tensor, in f32, in numpy (GGUF reader) order."""
    parts = name.split(".")
    if parts[0] != "blk":
        return sd[TOP_NAMES[parts[0]]].float().numpy()
    i, short = int(parts[1]), parts[2]
    if short in EXPERT_PROJ:
        rows = [sd[f"model.layers.{i}.mlp.experts.{e}.{EXPERT_PROJ[short]}.weight"] for e in range(experts)]
        return torch.stack(rows).float().numpy()
    return sd[ARCH_NAMES[arch][".".join(parts[2:])].format(i=i)].float().numpy()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_names_and_types_are_llama_cpps(written, case):
    reader = written[case][0]
    arch, quant, layers, experts, inter = case
    names = [t.name for t in reader.tensors]
    per_layer = [*ARCH_NAMES[arch], *(f"{n}.weight" for n in EXPERT_PROJ)]
    want = [f"{n}.weight" for n in TOP_NAMES] + [f"blk.{i}.{n}" for i in range(layers) for n in per_layer]
    assert sorted(names) == sorted(want)
    # llama.cpp's loader order: outside the blocks first, then by layer number, then by name
    assert names == sorted(names, key=lambda n: (int(n.split(".")[1]) if n.startswith("blk.") else -1, n))
    for t in reader.tensors:
        want_type = expected(quant, layers, experts, t.name)
        if inter % 256 and "ffn_down_exps" in t.name:  # rows of 96: llama-quantize's fallbacks
            want_type = {"Q6_K": "Q8_0", "Q4_K": "Q5_0"}[want_type]
        assert t.tensor_type.name == want_type, t.name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gguf_holds_the_safetensors_model(written, case):
    reader, sd, _ = written[case]
    for t in reader.tensors:
        ref = hf_reference(t.name, sd, case[0], case[3])
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape)
        kind = t.tensor_type.name
        if kind in ("F32", "BF16"):
            assert np.array_equal(got, ref), t.name  # bit for bit: bf16 widened, or kept
            continue
        err = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
        assert 0 < err < REL_RMS[kind], (t.name, kind, err)


def test_each_expert_is_its_own(written):
    """Expert e of the stacked tensor is expert e of the checkpoint, not a neighbour."""
    reader, sd, _ = written[CASES[0]]
    for name in ("blk.5.ffn_down_exps.weight", "blk.6.ffn_gate_exps.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        ref = hf_reference(t.name, sd, "qwen3_moe", 16)
        for e in range(16):
            errs = [np.linalg.norm(got[e] - ref[j]) / np.linalg.norm(ref[j]) for j in range(16)]
            assert int(np.argmin(errs)) == e and errs[e] < REL_RMS[t.tensor_type.name], (name, e, errs[e])


def test_tensors_longer_than_a_noise_chunk_are_exact(tmp_path):
    """A 40,000 x 256 embedding spans two noise chunks and three row blocks: still the same values."""
    from moestream import ggml

    args = dict(SHAPE, layers=1, experts=4, vocab_size=40_000)
    synthesize(tmp_path / "st", **args)
    sd = load_file(str(tmp_path / "st" / "model.safetensors"))
    for quant in ("BF16", "Q8_0"):
        synthesize(tmp_path / f"{quant}.gguf", format="gguf", quant=quant, threads=2, **args)
        tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / f"{quant}.gguf")).tensors}
        for name, hf in (
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
        ):
            data = np.asarray(tensors[name].data).reshape(-1).view(np.uint8)
            ref = sd[hf].float()
            want = ref.to(torch.bfloat16).view(torch.uint8) if quant == "BF16" else ggml.quantize(ref, "Q8_0")
            assert np.array_equal(data, want.reshape(-1).numpy()), (quant, name)


def test_metadata_is_what_llama_cpp_reads(written):
    reader, _, path = written[CASES[0]]
    assert field(reader, "general.architecture") == "qwen3moe"
    assert field(reader, "general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert field(reader, "general.quantization_version") == 2
    hp = {
        "block_count": 8,
        "embedding_length": 256,
        "expert_count": 16,
        "expert_used_count": 2,
        "expert_feed_forward_length": 256,
        "feed_forward_length": 1024,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 64,
        "attention.value_length": 64,
        "context_length": 4096,
    }
    for key, value in hp.items():
        assert field(reader, f"qwen3moe.{key}") == value, key
    assert field(reader, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert field(reader, "qwen3moe.rope.freq_base") > 0
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 1024
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:3] == [3, 3, 3]
    assert set(types[3:]) == {1}  # NORMAL
    assert len(field(reader, "tokenizer.ggml.merges")) > 500
    assert field(reader, "tokenizer.ggml.eos_token_id") == 0
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    marker = json.loads(field(reader, "moestream.synth"))
    assert marker["synthetic"] is True and marker["quant"] == "Q4_K_M" and marker["seed"] == 3
    assert marker["total_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert path.stat().st_size > marker["total_bytes"]


def test_out_of_order_chunks_equal_the_sequential_ones():
    """The GGUF writer's random access gives each tensor the bytes it gets in the safetensors order."""
    from moestream.synth.build import meta_model
    from moestream.synth.configs import build_config
    from moestream.synth.shapes import resolve_spec

    spec = resolve_spec(layers=2, experts=4, top_k=2, hidden=64, moe_intermediate=32, arch="qwen3_moe")
    model = meta_model(build_config(spec, 1024, 0, 0))
    specs = checkpoint_tensors(model, "qwen3_moe", "bf16", experts=4, hidden=64, moe_intermediate=32)
    scheme, seq, rand = InitScheme(), NoiseSource(7), NoiseSource(7)
    ats = first_chunks(specs)
    in_order = [torch.cat(list(chunks_for(s, scheme, seq, model, 7))) for s in specs]
    for i in reversed(range(len(specs))):
        got = torch.cat(list(chunks_for(specs[i], scheme, rand, model, 7, at=ats[i])))
        assert torch.equal(got, in_order[i]), specs[i].name
    assert len(set(ats)) > len(specs) // 2


def test_cli_writes_gguf_and_reports(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    argv = ["synth", str(out), "--arch", "qwen3_moe", "--layers", "2", "--experts", "8", "--top-k", "2"]
    assert main([*argv, "--hidden", "256", "--moe-intermediate", "256", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "Q4_K_M" in text and "one GGUF file" in text and "Q6_K x" in text
    assert gguf.GGUFReader(str(out)).get_field("general.file_type").contents() == 15
    assert not list(tmp_path.glob(".*partial*"))
    assert main([*argv, "--hidden", "256", "--moe-intermediate", "256"]) == 2
    assert "exists (use --force" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--quant", "Q2_K"], "unknown GGUF quantization 'Q2_K'"),
        (["--arch", "mixtral"], "--format gguf writes qwen3_moe, qwen2_moe, olmoe models; mixtral is not"),
        (["--arch", "olmoe"], "llama.cpp's olmoe normalises keys over all attention heads"),
        (["--format", "safetensors", "--quant", "Q8_0"], "--quant is for --format gguf"),
        (["--threads", "0"], "--threads must be at least 1"),
    ],
)
def test_gguf_user_errors_are_one_sentence(tmp_path, capsys, extra, message):
    argv = ["synth", str(tmp_path / "x.gguf"), "--layers", "1", "--experts", "4", "--top-k", "2"]
    argv += ["--hidden", "256", "--moe-intermediate", "256", *extra]
    if "--arch" not in extra:
        argv += ["--arch", "qwen3_moe"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


_RSS_SCRIPT = """
import resource, sys
from moestream.synth import synthesize
synthesize(sys.argv[1], arch="qwen3_moe", layers=2, experts=64, top_k=2, hidden=1024,
           moe_intermediate=int(sys.argv[2]), format="gguf", quant="Q8_0", threads=2)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_memory_stays_bounded(tmp_path):
    """Peak RSS of a ~215 MB Q8_0 write exceeds that of a 7 MB one by far less than the file size."""

    def peak(inter: int) -> tuple[int, int]:
        path = tmp_path / f"m{inter}.gguf"
        run = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), str(inter)], capture_output=True)
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        return int(run.stdout.split()[-1]), path.stat().st_size

    small, _ = peak(32)
    big, size = peak(512)  # 2 layers x 64 experts x 3 x 512 x 1024 values in Q8_0: 214 MB
    assert size > 200e6
    assert big - small < size / 8, (big, small, size)
