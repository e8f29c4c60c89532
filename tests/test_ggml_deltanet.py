"""The ggml graphs of Qwen3-Next and Qwen3.5 (qwen3_next, qwen3_5_moe): Gated DeltaNet layers (conv and
recurrent states living with the request), gated full attention with partial rope, zero-centred norms,
softmax routers with a sigmoid-gated shared expert.

Oracle: stock transformers in fp32 (its chunked gated delta rule over a prompt, the recurrent one per
decoded token) on checkpoints whose vectors are random (norms, A_log, dt_bias: a fresh model's zeros and
ones would hide a 1 + w or a decay gone wrong), over a prompt of several prefill chunks and decode steps
across attention spans. Tolerance 1% of the largest logit: the full-attention layer keeps keys and values
in F16 (4% in test_ggml_runner, whose families have no other kind of layer); the DeltaNet layers are f32
throughout, ggml's delta rule summing token by token where transformers' chunked one does not, and q, k
normalised by max(|x|, eps) instead of sqrt(|x|^2 + eps). Measured 0.03% (both families).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_ggml_runner import (
    PROMPT,
    _runner_logits,
    _small_steps,
    _stock_greedy,
    _stock_logits,
    _streamed_equals_resident,
)

import moestream

ARCHS = ["qwen3_next", "qwen3_5_moe"]
TOLERANCE = 0.01  # of the largest |logit|
LONG = PROMPT * 3  # 36 tokens: 8 prefill chunks of 5


def _close(got: torch.Tensor, ref: torch.Tensor, tolerance: float = TOLERANCE, tie: float = 0.0) -> None:
    """Within `tolerance` of the largest |logit|, and the same argmax at every position whose top two
    logits in `ref` are more than `tie` apart."""
    diff = (got - ref).abs().max().item()
    assert diff <= tolerance * ref.abs().max().item(), diff
    top = ref.topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > tie
    assert clear.sum() >= len(clear) - 1
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_match_stock_over_prefill_chunks_and_decode_steps(arch, tiny_gguf, monkeypatch):
    _small_steps(monkeypatch)  # the decode steps cross spans 40 and 48
    hf, _ = tiny_gguf(arch)
    ref = _stock_logits(hf, LONG)
    want = _stock_greedy(hf, LONG, 16)
    with moestream.load(str(hf), cache="64MiB", trunk="ggml") as engine:
        assert f"trunk ggml graphs ({arch}" in engine.mode_line()
        spec = engine.runner.spec
        assert [layer.linear is not None for layer in spec.layers] == [True, False]
        assert spec.layers[1].attention.gated and spec.rope_dims == 4  # partial rotary: 16 * 0.25
        _close(_runner_logits(engine, LONG), ref)
        gen = engine.generate(LONG, max_tokens=16, ignore_eos=True)
    assert gen.tokens == want


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_equals_resident_bit_for_bit(arch, tiny_dir):
    _streamed_equals_resident(tiny_dir(arch), fused=True)  # f32 experts, slots a page apart


@pytest.mark.parametrize("arch", ARCHS)
def test_a_second_request_starts_from_zero_states(arch, tiny_dir):
    """The conv and recurrent states are the request's: zeroed when one starts, so the same prompt after
    another request gives the same bits and tokens."""
    with moestream.load(str(tiny_dir(arch)), cache="64MiB", trunk="ggml") as engine:
        first = _runner_logits(engine)
        tokens = engine.generate(PROMPT, max_tokens=10, ignore_eos=True).tokens
        engine.generate(LONG[5:], max_tokens=10, ignore_eos=True)
        assert engine.generate(PROMPT, max_tokens=10, ignore_eos=True).tokens == tokens
        assert torch.equal(_runner_logits(engine), first)
        runner = engine.runner
        conv, state = runner.kv[0]
        assert state.abs().sum() > 0 and conv.abs().sum() > 0  # the states in use: something to reset


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prompt_cache_continues_the_states_only_exactly(arch, tiny_dir):
    """An exact continuation feeds only the new tokens after the held states; a prompt that drops a held
    token starts over (recurrent states cannot be cropped), and both give the tokens of a cold run."""
    with moestream.load(str(tiny_dir(arch)), cache="64MiB", trunk="ggml") as engine:
        first = engine.generate(PROMPT, max_tokens=6, ignore_eos=True, cache_prompt=True)
        longer = PROMPT + first.tokens + [11, 12, 13]
        warm = engine.generate(longer, max_tokens=8, ignore_eos=True, cache_prompt=True)
        assert warm.cached_tokens == len(PROMPT) + len(first.tokens) - 1
        assert engine.prompt_cache.nbytes() > 0
        diverging = engine.generate(PROMPT[:6] + [7, 8], max_tokens=8, ignore_eos=True, cache_prompt=True)
        assert diverging.cached_tokens == 0
        assert warm.tokens == engine.generate(longer, max_tokens=8, ignore_eos=True).tokens
        assert diverging.tokens == engine.generate(PROMPT[:6] + [7, 8], max_tokens=8, ignore_eos=True).tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_q8_0_graphs_match_the_transformers_path(arch, tiny_gguf):
    """A Q8_0 GGUF (its projections as stored; Qwen3.5's value heads in llama.cpp's tiled order, put back
    by the loader, whose rows move as whole blocks: still Q8_0; A_log stored as -exp, norms as 1 + w): the
    graphs follow the transformers path on the same file within 5% (F16 attention against its F32, the
    delta rule summed in another order; measured 1%) and pick the same tokens but where the path's top two
    are within 0.05 (tiny qwen3_5_moe's fourth step: 0.012 apart); streamed == resident."""
    _, path = tiny_gguf(arch, ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.Q8_0)
    with moestream.load(str(path), cache="64MiB", trunk="eager") as engine:
        eager = _runner_logits(engine)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert f"trunk ggml graphs ({arch}" in engine.mode_line()
        d = engine.runner.spec.layers[0].linear
        if arch == "qwen3_5_moe":  # its value heads' rows moved as whole blocks, out_proj's input permuted
            assert all(m.type_id == Q.Q8_0 for m in (d.qkv, d.z, d.b, d.a, d.out)) and d.out_tiled
            out_proj = engine.model.model.layers[0].linear_attn.out_proj  # the file's bytes, no f32 copy
            assert out_proj.inputs is not None and out_proj.raw.numel() == out_proj.ref.nbytes
        got = _runner_logits(engine)
    _close(got, eager, 0.05, tie=0.05)
    _streamed_equals_resident(path, fused=False)


def test_a_composite_qwen3_5_config_loads_and_runs_the_graphs(tmp_path):
    """Real Qwen3.5 / 3.6 checkpoints carry the vision-language config (model_type qwen3_5_moe, the text
    model's under text_config) over `model.language_model.*` keys: the causal LM is built from the text
    config, as AutoModelForCausalLM.from_pretrained swaps it (a composite config failed with 'no attribute
    vocab_size'), and its graphs follow stock transformers on the same directory."""
    from moestream.synth.build import synthesize

    path = synthesize(
        tmp_path / "q35",
        arch="qwen3_5_moe",
        layers=4,
        dtype="fp32",
        experts=8,
        top_k=2,
        hidden=64,
        moe_intermediate=32,
    )
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert (
            engine.config.model_type == "qwen3_5_moe"
            and "trunk ggml graphs (qwen3_5_moe" in engine.mode_line()
        )
        assert sum(layer.linear is not None for layer in engine.runner.spec.layers) == 3
        _close(_runner_logits(engine), ref)


MOVED = ("attn_qkv.", "attn_gate.", "ssm_ba.", "ssm_alpha.", "ssm_beta.")  # GGUF names of the moved rows
MOVED_KEYS = {  # the transformers weights made of them, layer 0
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba"),
    "qwen3_5_moe": ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_linear_attention_rows_kept_as_blocks(arch, tmp_path, monkeypatch):
    """llama.cpp stores Qwen3.5's value heads tiled and splits Qwen3-Next's in_proj_qkvz into attn_qkv and
    attn_gate; the loader puts their Q8_0 rows back in transformers' order as whole rows, so they stay
    blocks: of weights rounded through Q8_0 (what the GGUF holds exactly), each block matrix is the
    checkpoint's weight bit for bit, and the graphs compute them as blocks. qwen3_5_moe end to end against
    stock: within 5% (8-bit activations into its in_proj_qkv: measured 3.1%, the transformers path on the
    same file alike; tiny qwen3_next is more sensitive to them: 17%, its composed f32 in_proj_qkvz
    before 0%) and the same tokens but at near ties. The rows left in the stored order are wrong."""
    import tiny_gguf
    from safetensors.torch import load_file
    from tiny_models import write_tiny

    from moestream.store import tensors
    from moestream.store.gguf import GgufSource
    from moestream.store.gguf_trunk import Trunk

    hf = write_tiny(arch, tmp_path / "hf", **tiny_gguf.OVERRIDES.get(arch, {}))
    tiny_gguf.perturb_vectors(hf)
    tiny_gguf.round_weights(hf, Q.Q8_0, lambda key: "conv1d" not in key)
    add = tiny_gguf._add

    def moved_only(w, name, data, ftype, expert_type):
        return add(w, name, data, ftype if any(m in name for m in MOVED) else Q.F32, expert_type)

    monkeypatch.setattr(tiny_gguf, "_add", moved_only)
    path = tiny_gguf.write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0)
    source, weights = GgufSource(path), load_file(hf / "model.safetensors")
    prefix = "model.language_model" if arch == "qwen3_5_moe" else "model"

    def trunk_weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
        trunk = Trunk(source.arch.name, source.arch.tensor_arch, source.config(), source.tensors)
        pairs = []
        for name in MOVED_KEYS[arch]:
            want = weights[f"{prefix}.layers.0.linear_attn.{name}.weight"]
            got = trunk.tensor(f"model.layers.0.linear_attn.{name}.weight", tuple(want.shape), set())
            assert isinstance(got, tensors.QuantizedTensor)
            pairs.append((got.dequantize(torch.float32), want))
        return pairs

    assert all(torch.equal(got, want) for got, want in trunk_weights())
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        d = engine.runner.spec.layers[0].linear
        moved = (d.qkv, d.z, d.b, d.a) if arch == "qwen3_5_moe" else (d.qkvz, d.ba)
        assert all(m.type_id == Q.Q8_0 for m in moved)
        got = _runner_logits(engine)
    if arch == "qwen3_5_moe":
        _close(got, _stock_logits(hf), 0.05, tie=0.05)

    def as_stored(self) -> torch.Tensor:  # the rows one after another, not moved
        return torch.cat([tensors.read_bytes(p) for p in self.parts or (self.ref,)])

    monkeypatch.setattr(tensors.QuantizedTensor, "raw", as_stored)
    assert not all(torch.equal(got, want) for got, want in trunk_weights())


def _round_tiled_out_proj(hf) -> None:
    """Round Qwen3.5's out_proj through Q8_0 in the order the GGUF stores its columns (value heads tiled):
    tiny heads of 16 share a 32-block, which the reorder would otherwise regroup."""
    import gguf
    from safetensors.torch import load_file, save_file
    from tiny_gguf import _reorder_v
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf).get_text_config()
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    path = hf / "model.safetensors"
    sd = load_file(path)
    for key, value in sd.items():
        if key.endswith("linear_attn.out_proj.weight"):
            tiled = _reorder_v(value.float(), 1, nk, nv // nk, dv).numpy()
            tiled = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tiled, Q.Q8_0), Q.Q8_0))
            sd[key] = tiled.reshape(-1, nv // nk, nk, dv).transpose(1, 2).reshape(value.shape).contiguous()
    save_file(sd, path, metadata={"format": "pt"})


def _exact_in_q8(rows: int, cols: int, group: int, g: torch.Generator) -> torch.Tensor:
    """Integer activations whose every head (`group` values) holds 127: ggml's 8-bit activations are
    these values exactly (scale 1 in every 32-block of whole heads), so a product on them differs from
    the f64 one by float rounding only."""
    x = torch.randint(-127, 128, (rows, cols), generator=g).float()
    x[:, ::group] = 127.0
    return x


def _graph_out_projection(d, x: torch.Tensor) -> torch.Tensor:
    """graphs.qwen3_next.out_projection alone, one graph on x [T, Hv D] (ggml [D, Hv, T]) -> [T, hidden]."""
    from ggml_graph import run_once

    from moestream.ggml.net import F32
    from moestream.graphs.qwen3_next import out_projection

    T = x.shape[0]

    def build(net):
        return out_projection(net, net.tensor(F32, [d.head_dim, d.v_heads, T], x.data_ptr()), d, T)

    return run_once(build, torch.empty(T, d.out.rows))


def test_out_proj_kept_as_the_files_blocks_its_input_permuted(tiny_gguf):
    """Qwen3.5's out_proj, whose columns llama.cpp stores with the value heads tiled: moving them back
    would split its blocks (f32 before: ~1 GB for Qwen3.5-35B-A3B), so it stays the file's Q8_0 bytes,
    unmoved, and its input is permuted from grouped to tiled heads instead: on transformers' path (a
    QuantLinear's index_select; one row by ggml's 8-bit kernel, many by F.linear) and in the ggml graph
    (a head permute before the product). Both equal the file's out_proj dequantized by `gguf`, its columns
    moved back by this test, times the input in f64, within float rounding; without the permutation both
    are wrong, and a graph matrix refuses a permuted QuantLinear it is not told about."""
    import types

    import gguf

    from moestream.graphs.parts import NoGraph, matrix
    from moestream.model.quantized import QuantLinear
    from moestream.store.gguf import GgufSource
    from moestream.store.gguf_trunk import Trunk
    from moestream.store.tensors import QuantizedTensor, read_bytes

    _, path = tiny_gguf("qwen3_5_moe", ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.Q8_0)
    source = GgufSource(path)
    cfg = source.config()
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    r, width = nv // nk, nv * dv
    assert r > 1
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ssm_out.weight")
    assert stored.tensor_type == Q.Q8_0
    tiled = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type)).double()
    moved = tiled.reshape(-1, r, nk, dv).transpose(1, 2).reshape(-1, width)  # tiled [r, nk] -> grouped

    trunk = Trunk(source.arch.name, source.arch.tensor_arch, cfg, source.tensors)
    value = trunk.tensor("model.layers.0.linear_attn.out_proj.weight", (cfg.hidden_size, width), set())
    assert isinstance(value, QuantizedTensor) and value.type_name == "Q8_0" and value.rows is None
    ref = source.tensors["blk.0.ssm_out.weight"]
    assert torch.equal(value.raw(), read_bytes(ref)) and value.raw().numel() == ref.nbytes
    assert torch.equal(value.dequantize(torch.float64), moved)

    layer = QuantLinear(value.raw(), value, None)
    g = torch.Generator().manual_seed(0)
    for rows in (1, max(layer.format().threshold, 2)):
        x = _exact_in_q8(rows, width, dv, g)
        want = x.double() @ moved.T
        scale = want.abs().max().item()
        assert (layer(x).double() - want).abs().max().item() <= 1e-6 * scale, rows
        inputs, layer.inputs = layer.inputs, None
        assert (layer(x).double() - want).abs().max().item() > 0.1 * scale, rows  # not permuted
        layer.inputs = inputs

    with pytest.raises(NoGraph):
        matrix(layer)
    d = types.SimpleNamespace(
        head_dim=dv, k_heads=nk, v_heads=nv, out=matrix(layer, permuted_inputs=True), out_tiled=True
    )
    x = _exact_in_q8(7, width, dv, g)
    want = x.double() @ moved.T
    scale = want.abs().max().item()
    assert (_graph_out_projection(d, x).double() - want).abs().max().item() <= 1e-6 * scale
    d.out_tiled = False
    assert (_graph_out_projection(d, x).double() - want).abs().max().item() > 0.1 * scale  # not permuted


def test_out_proj_as_blocks_end_to_end_against_stock(tmp_path, monkeypatch):
    """A Qwen3.5 GGUF whose out_proj alone is Q8_0 (of weights rounded through Q8_0 with its columns in the
    file's tiled order: what the file holds exactly): the loader's out_proj is the checkpoint's weight bit
    for bit once dequantized; computed by F.linear on its blocks (8-bit activations off) the transformers
    path follows stock to float rounding (measured 3e-6 of the largest logit), and not with the input left
    unpermuted; with ggml's 8-bit activations the graphs and the transformers path are within 5% (measured
    1.4%; 0.04% with out_proj f32 before) and pick the same tokens but at near ties."""
    import tiny_gguf
    from safetensors.torch import load_file
    from tiny_models import write_tiny

    from moestream import ggml
    from moestream.store import tensors
    from moestream.store.gguf import GgufSource
    from moestream.store.gguf_trunk import Trunk

    arch = "qwen3_5_moe"
    hf = write_tiny(arch, tmp_path / "hf", **tiny_gguf.OVERRIDES[arch])
    tiny_gguf.perturb_vectors(hf)
    _round_tiled_out_proj(hf)
    add = tiny_gguf._add

    def out_proj_only(w, name, data, ftype, expert_type):
        return add(w, name, data, ftype if ".ssm_out." in name else Q.F32, expert_type)

    monkeypatch.setattr(tiny_gguf, "_add", out_proj_only)
    path = tiny_gguf.write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0)
    source = GgufSource(path)
    trunk = Trunk(source.arch.name, source.arch.tensor_arch, source.config(), source.tensors)
    want = load_file(hf / "model.safetensors")["model.language_model.layers.0.linear_attn.out_proj.weight"]
    got = trunk.tensor("model.layers.0.linear_attn.out_proj.weight", tuple(want.shape), set())
    assert isinstance(got, tensors.QuantizedTensor) and got.type_name == "Q8_0"
    assert torch.equal(got.dequantize(torch.float32), want)

    stock = _stock_logits(hf)
    for trunk_kind in ("ggml", "eager"):
        with moestream.load(str(path), cache="64MiB", trunk=trunk_kind) as engine:
            out_proj = engine.model.model.layers[0].linear_attn.out_proj
            assert out_proj.stored.name == "Q8_0" and out_proj.inputs is not None
            _close(_runner_logits(engine), stock, 0.05, tie=0.05)
    monkeypatch.setattr(ggml, "dequant_threshold", lambda *args: 1)  # F.linear on the dequantized blocks
    with moestream.load(str(path), cache="64MiB", trunk="eager") as engine:
        exact = _runner_logits(engine)
    assert (exact - stock).abs().max().item() <= 1e-4 * stock.abs().max().item()
    monkeypatch.setattr(tensors.QuantizedTensor, "stored_inputs", property(lambda self: None))
    with moestream.load(str(path), cache="64MiB", trunk="eager") as engine:
        unpermuted = _runner_logits(engine)
    assert (unpermuted - stock).abs().max().item() > 0.05 * stock.abs().max().item()
