"""GGUF files as llama.cpp users have them: F16/BF16, quantized experts and trunks, splits, directories."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
import warnings

import gguf
import numpy as np
import pytest
import torch
import transformers as T
from gguf import GGMLQuantizationType as Q
from tiny_gguf import perturb_vectors, round_weights, write_gguf
from tiny_models import write_tiny

import moestream
from moestream.cli import main
from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.model.arch import arch_for
from moestream.model.loader import ExpectedKeys, _causal_lm_class
from moestream.store.gguf import GgufSource
from moestream.store.gguf_tokenizer import NEEDS, gguf_tokenizer, transformers_builds_gguf_tokenizers
from moestream.store.safetensors_dir import SafetensorsSource
from moestream.store.source import open_source
from moestream.store.tensors import read_bytes

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250]


def _hf(tmp_path, arch="qwen3_moe", **overrides):
    hf = write_tiny(arch, tmp_path / "hf", **overrides)
    perturb_vectors(hf)
    return hf


def _stock(hf_dir, tokens=16):
    model = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])
    full = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    with torch.inference_mode():
        return full, model(full).logits[0]


def _assert_streams_like(path, hf_dir, **load):
    full, ref_logits = _stock(hf_dir)
    # the transformers path: stock transformers' tokens and logits bit for bit (the ggml graphs have
    # their own tolerance, tests/test_ggml_runner.py)
    with moestream.load(str(path), cache="1MiB", **{"trunk": "eager", **load}) as engine:
        gen = engine.generate(PROMPT, max_tokens=full.shape[1] - len(PROMPT), ignore_eos=True)
        assert gen.tokens == full[0, len(PROMPT) :].tolist()
        with torch.inference_mode():
            assert (engine.model(full).logits[0] - ref_logits).abs().max().item() <= 1e-5
        return engine.emap


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_f16_and_bf16_files_stream_like_stock_with_the_same_rounded_weights(tmp_path, qtype):
    hf = _hf(tmp_path)
    round_weights(hf, qtype)
    path = write_gguf(hf, tmp_path / "model.gguf", ftype=qtype)
    emap = _assert_streams_like(path, hf, dtype="float32")
    assert {f.name for f in emap.formats.values()} == {qtype.name}
    with moestream.load(str(path), cache="1MiB") as engine:  # computes in the file's type by default
        assert engine.dtype == (torch.bfloat16 if qtype == Q.BF16 else torch.float32)


def _q8_0_trunk(tmp_path):
    """A Q8_0 trunk (as in MXFP4_MOE files) with F32 experts, and the HF checkpoint of the same weights."""
    hf = _hf(tmp_path)
    routed = (".mlp.experts.", ".mlp.gate.")  # experts stay F32 here, routers are F32 in every GGUF
    round_weights(hf, Q.Q8_0, lambda key: not any(part in key for part in routed))
    path = write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.F32)
    assert GgufSource(path).tensors["blk.0.attn_q.weight"].dtype == "Q8_0"
    return hf, path


def test_dequantized_trunk_streams_like_stock(tmp_path):
    """--trunk-dtype float32: the Q8_0 trunk dequantized at load == stock transformers on the same weights."""
    hf, path = _q8_0_trunk(tmp_path)
    _assert_streams_like(path, hf, trunk_dtype="float32")


def test_quantized_trunk_is_computed_on_its_blocks_in_its_file_size(tmp_path):
    """By default the trunk stays Q8_0 (ggml on the blocks): its memory is its bytes in the file, and
    the model still follows stock transformers on the dequantized weights: the same greedy tokens, and
    logits within 0.2 at 90% of the positions, 10% relative overall. Why not closer: ggml quantizes
    every product's activations to Q8_0 (~5e-3 relative per matmul, measured in tests/test_ggml_kernels),
    compounding over a dozen chained matmuls (logits here reach ~7: ~0.05-0.13 per position, measured),
    and a position whose router logits nearly tie can pick another expert, a jump of order 1 there."""
    from moestream.model.quantized import QuantEmbedding, QuantLinear

    hf, path = _q8_0_trunk(tmp_path)
    full, ref_logits = _stock(hf)
    source = GgufSource(path)
    blocks = {n: r.nbytes for n, r in source.tensors.items() if r.dtype == "Q8_0"}
    trunk_in_file = sum(r.nbytes for n, r in source.tensors.items() if "_exps" not in n)
    with moestream.load(str(path), cache="1MiB") as engine:
        modules = list(engine.model.modules())
        assert any(isinstance(m, QuantEmbedding) for m in modules)
        assert sum(isinstance(m, QuantLinear) for m in modules) >= len(blocks) - 1  # all but the embedding
        held = sum(t.untyped_storage().nbytes() for t in engine.model.state_dict().values())
        held += sum(m.raw.numel() for m in modules if isinstance(m, (QuantLinear, QuantEmbedding)))
        assert held <= 1.1 * trunk_in_file, (held, trunk_in_file)
        gen = engine.generate(PROMPT, max_tokens=full.shape[1] - len(PROMPT), ignore_eos=True)
        assert gen.tokens == full[0, len(PROMPT) :].tolist()
        with torch.inference_mode():
            logits = engine.model(full).logits[0]
        per_position = (logits - ref_logits).abs().amax(-1)
        assert (per_position <= 0.2).float().mean().item() >= 0.9, per_position
        assert ((logits - ref_logits).norm() / ref_logits.norm()).item() <= 0.1


def _q4_k_m(layer: int, kind: str) -> Q:
    """llama.cpp's Q4_K_M rule for two layers: ffn_down at Q6_K in the first layer (i < n/8), Q4_K else."""
    return Q.Q6_K if kind == "down" and layer == 0 else Q.Q4_K


def _reader_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor dequantized by gguf's own reader: an oracle independent of moestream's offsets."""
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


def _expert_values(ref, qtype: Q) -> np.ndarray:
    """The exact bytes of one expert's range, dequantized: [rows, cols]."""
    raw = read_bytes(ref).numpy().reshape(ref.shape[0], -1)
    return gguf.quants.dequantize(raw, qtype)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A Q4_K_M-style qwen3moe GGUF: hidden and expert width 256, the K-quant block."""
    root = tmp_path_factory.mktemp("q4km")
    hf = write_tiny("qwen3_moe", root / "hf", hidden_size=256, moe_intermediate_size=256)
    return write_gguf(hf, root / "model-Q4_K_M.gguf", expert_type=_q4_k_m)


def test_q4_k_m_mix_records_each_layer_and_kind_and_expert_ranges_hold_the_experts(q4_k_m):
    source = open_source(q4_k_m)
    emap = source.expert_map("swiglu", 8)
    assert {key: f.name for key, f in emap.formats.items()} == {
        (0, "gate"): "Q4_K",
        (0, "up"): "Q4_K",
        (0, "down"): "Q6_K",
        (1, "gate"): "Q4_K",
        (1, "up"): "Q4_K",
        (1, "down"): "Q4_K",
    }
    whole = _reader_tensors(q4_k_m)
    for (layer, e), parts in emap.units.items():
        for kind, (ref,) in parts.items():
            assert ref.nbytes == ref.shape[0] * ref.shape[1] // 256 * gguf.GGML_QUANT_SIZES[Q[ref.dtype]][1]
            got = _expert_values(ref, Q[emap.formats[(layer, kind)].name])
            assert np.array_equal(got, whole[f"blk.{layer}.ffn_{kind}_exps.weight"][e]), (layer, e, kind)
    assert emap.unit_bytes(0, 0) > emap.unit_bytes(1, 0)  # Q6_K down is larger


def test_info_prints_formats_per_kind_and_sizes(q4_k_m, capsys):
    assert main(["info", str(q4_k_m), "--no-routing", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["formats_by_kind"] == {"gate": {"Q4_K": 2}, "up": {"Q4_K": 2}, "down": {"Q6_K": 1, "Q4_K": 1}}
    q4k, q6k = 256 // 256 * 144, 256 // 256 * 210  # bytes of one 256-value row
    assert info["expert_bytes"] == 256 * (2 * q4k + q6k) and info["expert_bytes_min"] == 256 * 3 * q4k
    assert main(["info", str(q4_k_m), "--no-routing"]) == 0
    assert "down Q6_K (1 layers), Q4_K (1 layers)" in capsys.readouterr().out


def test_mxfp4_moe_file_maps_mxfp4_experts_biases_and_a_q8_0_trunk(tmp_path):
    """gpt-oss as MXFP4_MOE: experts MXFP4 (gguf's layout, 17-byte blocks), everything else Q8_0."""
    hf = _hf(tmp_path, "gpt_oss")
    path = write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.MXFP4)
    source = open_source(path)
    emap = source.expert_map("gpt_oss", 8)
    assert emap.kinds == ("gate", "up", "down")
    assert {f.name for f in emap.formats.values()} == {"MXFP4"}
    assert set(emap.resident) == {(layer, f"{k}_bias") for layer in (0, 1) for k in ("gate", "up", "down")}
    sd = T.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    for (layer, e), parts in emap.units.items():
        gate_up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e].T  # [2I, H], gate/up interleaved
        down = sd[f"model.layers.{layer}.mlp.experts.down_proj"][e].T  # [H, I]
        written = {"gate": gate_up[::2], "up": gate_up[1::2], "down": down}
        for kind, (ref,) in parts.items():
            want = gguf.quants.dequantize(gguf.quants.quantize(written[kind].numpy(), Q.MXFP4), Q.MXFP4)
            assert np.array_equal(_expert_values(ref, Q.MXFP4), want), (layer, e, kind)
    config = source.config()
    expected = ExpectedKeys(_causal_lm_class(config), config)
    trunk = source.trunk_state_dict(emap, expected, keep_blocks=False)
    embed = sd["model.embed_tokens.weight"].numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(embed, Q.Q8_0), Q.Q8_0)
    assert np.array_equal(trunk["model.embed_tokens.weight"][...].numpy(), want)
    assert arch_for(config).family == "gpt_oss"


def test_split_gguf_loads_from_its_first_part(tmp_path):
    hf = _hf(tmp_path)
    first = write_gguf(hf, tmp_path / "model.gguf", split_max_tensors=12)
    parts = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert first == parts[0] and len(parts) >= 2
    assert len(GgufSource(first).files) == len(parts)
    _assert_streams_like(first, hf)
    with pytest.raises(CheckpointError, match="open its first part"):
        GgufSource(parts[1])
    parts[1].unlink()
    with pytest.raises(CheckpointError, match=f"part {parts[1].name} .* is missing"):
        GgufSource(first)


def test_a_directory_holding_a_gguf_opens_it_and_a_hf_checkpoint_beside_one_wins(tmp_path):
    hf = _hf(tmp_path)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(hf, tmp_path / "gguf" / "model.gguf")
    assert isinstance(open_source(tmp_path / "gguf"), GgufSource)
    _assert_streams_like(tmp_path / "gguf", hf)
    shutil.copy(path, hf / "model.gguf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert isinstance(open_source(hf), SafetensorsSource)
    assert any("using the HF checkpoint" in str(w.message) for w in caught)


def test_cli_generate_and_perplexity_on_a_gguf_equal_the_hf_checkpoint(tmp_path, capsys):
    hf = _hf(tmp_path)
    path = write_gguf(hf, tmp_path / "model.gguf")
    results = []
    for target in (hf, path):
        assert main(["generate", str(target), "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out)["tokens"])
    assert results[0] == results[1]
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    figures = []
    for target in (hf, path):
        assert main(["perplexity", str(target), "--text", str(text), "--ctx", "32", "--json"]) == 0
        figures.append(json.loads(capsys.readouterr().out)["perplexity"])
    assert figures[0] == pytest.approx(figures[1], rel=1e-6)


def _minimal_gguf(path, arch: str, experts: int | None, tensors: dict[str, np.ndarray] | None = None):
    """A GGUF with just enough metadata to name its architecture (and experts)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(1)
    for name, array in (tensors or {"token_embd.weight": np.zeros((8, 64), np.float32)}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cli_error(capsys, path) -> str:
    capsys.readouterr()  # what writing the file printed
    code = main(["generate", str(path), "--prompt", "Hello", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_dense_unknown_truncated_and_foreign_files_are_one_sentence(tmp_path, capsys):
    assert "dense qwen3 model" in _cli_error(capsys, _minimal_gguf(tmp_path / "dense.gguf", "qwen3", None))
    err = _cli_error(capsys, _minimal_gguf(tmp_path / "odd.gguf", "frobnicator", 4))
    assert "'frobnicator'" in err and "not supported" in err
    full = _minimal_gguf(tmp_path / "cut.gguf", "qwen3moe", 4)
    data = full.read_bytes()
    full.write_bytes(data[:-100])
    err = _cli_error(capsys, full)
    assert "is truncated" in err and "inside tensor token_embd.weight" in err
    (tmp_path / "head.gguf").write_bytes(data[:30])
    assert "truncated inside its GGUF header" in _cli_error(capsys, tmp_path / "head.gguf")
    absurd = (
        b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") * 2 + (1 << 60).to_bytes(8, "little")
    )
    (tmp_path / "absurd.gguf").write_bytes(absurd + b"x" * 64)  # a key claiming 2**60 bytes
    assert "truncated inside its GGUF header" in _cli_error(capsys, tmp_path / "absurd.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    assert "not a GGUF file" in _cli_error(capsys, tmp_path / "junk.gguf")
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a .gguf file" in _cli_error(capsys, tmp_path / "notes.txt")


def test_experts_of_a_type_no_format_computes_are_named(tmp_path, capsys):
    """I32 experts stand for any GGUF type that no weight format (torch or ggml) multiplies."""
    path = write_gguf(_hf(tmp_path), tmp_path / "model.gguf", expert_type=lambda layer, kind: Q.I32)
    err = _cli_error(capsys, path)
    assert "tensor blk.0.ffn_down_exps.weight[0]" in err and "I32 are not supported" in err


@pytest.mark.skipif(not transformers_builds_gguf_tokenizers(), reason=NEEDS)  # write_gguf skips the others
def test_a_gguf_written_by_moestream_synth_streams_like_it_does_resident(tmp_path):
    """Q4_K_M from `moestream synth` (llama.cpp's types, ggml's quantizer): the smallest budget gives
    the logits of every expert cached, bit for bit."""
    path = tmp_path / "synth-Q4_K_M.gguf"
    argv = ["synth", str(path), "--arch", "qwen3_moe", "--layers", "2", "--experts", "8", "--top-k", "2"]
    assert main([*argv, "--hidden", "256", "--moe-intermediate", "256", "--quant", "Q4_K_M"]) == 0
    assert GgufSource(path).synthetic
    with moestream.load(str(path), cache="64MiB") as engine:
        assert {f.name for f in engine.emap.formats.values()} == {"Q4_K", "Q6_K"}
        outputs = []
        for budget in (engine.cache.slot_bytes * len(engine.emap.units), engine.cache.slot_bytes * 2):
            engine.restream(cache=budget)
            gen = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
            with torch.inference_mode():
                outputs.append((gen.tokens, engine.model(torch.tensor([PROMPT + gen.tokens])).logits))
        assert engine.cache.stats.misses > len(engine.emap.units)
    assert outputs[0][0] == outputs[1][0] and torch.equal(outputs[0][1], outputs[1][1])


def test_unaligned_neighbouring_expert_ranges_read_with_o_direct_stay_intact(tmp_path):
    """Experts of 7844 bytes back to back inside one ffn_*_exps tensor, 32-byte aligned tensors."""
    from moestream.cache.expert_cache import ExpertCache
    from moestream.io.reader import Reader
    from moestream.runtime.weights import SlotTensors

    g = torch.Generator().manual_seed(3)
    weights = {
        "gate": torch.randn(2, 37, 53, generator=g),
        "up": torch.randn(2, 37, 53, generator=g),
        "down": torch.randn(2, 53, 37, generator=g),
    }
    tensors = {f"blk.0.ffn_{k}_exps.weight": v.numpy() for k, v in weights.items()}
    path = _minimal_gguf(tmp_path / "odd.gguf", "qwen3moe", 2, tensors)
    emap = GgufSource(path).expert_map("swiglu", 2)
    for kind in ("gate", "up", "down"):
        first, second = emap.units[(0, 0)][kind][0], emap.units[(0, 1)][kind][0]
        assert first.nbytes % 4096 and second.offset == first.end
    reader = Reader("direct", 4)
    assert reader.fallback_reason is None
    slot = sum(math.ceil(p.nbytes / 4096) * 4096 + 4096 for (p,) in emap.units[(0, 0)].values())
    cache = ExpertCache(emap, 2 * slot, reader, top_k=1, piece_bytes=4096, lock_memory=False)
    job = cache.open_layer(0, [0, 1])
    views, pending = SlotTensors(), {(e, k) for e in (0, 1) for k in weights}
    while pending:
        e, kind, err = job.next_event()
        assert err is None
        pending.discard((e, kind))
        ((buf, off, part),) = job.tensor_parts(e, kind)
        got = views.bytes_of(buf)[off : off + part.ref.nbytes].view(torch.float32).view(part.ref.shape)
        assert torch.equal(got, weights[kind][e]), (e, kind)
    for e in (0, 1):
        job.release(e)
    reader.close()


def test_multi_token_prediction_blocks_are_neither_streamed_nor_trunk(tmp_path):
    """GLM-4.5 GGUFs append their MTP block, experts included, as blk.{layers}: moestream runs without it."""
    hf = _hf(tmp_path, "glm4_moe")
    mtp = {
        f"blk.2.ffn_{kind}_exps.weight": np.ones((8, *shape), np.float32)
        for kind, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32)))
    }
    mtp["blk.2.nextn.eh_proj.weight"] = np.ones((64, 128), np.float32)
    path = write_gguf(hf, tmp_path / "model.gguf", extra=mtp)
    source = GgufSource(path)
    assert source.config().num_hidden_layers == 2 and source.config().num_nextn_predict_layers == 1
    assert source.expert_map("swiglu", 8).layers == [1]  # layer 0 is dense (first_k_dense_replace)
    _assert_streams_like(path, hf)


def test_serve_a_gguf_through_the_openai_client(tmp_path, capsys):
    """The server's own tokenizer copy comes from the GGUF too: chat output equals `generate --chat`."""
    from test_server_harness import SERVER_ARGS, LiveServer

    path = write_gguf(_hf(tmp_path), tmp_path / "model.gguf")
    capsys.readouterr()
    argv = ["generate", str(path), "--prompt", "Hi there", "--max-tokens", "6", "--ignore-eos", "--chat"]
    assert main([*argv, "--cache", "1MiB", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    server = LiveServer(path, SERVER_ARGS)
    try:
        out = server.client().chat.completions.create(
            model=server.model,
            temperature=0,
            max_tokens=6,
            messages=[{"role": "user", "content": "Hi there"}],
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].message.content == expected["text"]
        assert out.usage.prompt_tokens == expected["prompt_tokens"]
    finally:
        server.stop()


def test_transformers_5_17_is_told_to_upgrade(tmp_path, monkeypatch):
    """transformers 5.17's `integrations.gguf` has no `convert_gguf_tokenizer` (its GGUF tokenizers are
    Qwen3.5's only): building a GGUF's tokenizer, the first step of its load, is refused in one sentence
    naming the version that has it, before the file is read."""
    old = types.ModuleType("transformers.integrations.gguf")
    old.get_gguf_tokenizer = lambda path: pytest.fail("the file was read")
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf", old)
    needs = r"^building the tokenizer of a GGUF needs transformers >= 5\.18 "
    with pytest.raises(UnsupportedModelError, match=needs):
        gguf_tokenizer(tmp_path / "model.gguf")
