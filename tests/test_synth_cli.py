"""`moestream synth` verb, user errors, presets and the synthetic tokenizer."""

from __future__ import annotations

import json

import pytest

from moestream.cli import main
from moestream.errors import MoestreamError
from moestream.synth.shapes import PRESETS, resolve_spec
from moestream.synth.tokenizer import CHAT_TEMPLATE, build_tokenizer

TINY = [
    "--arch",
    "qwen3_moe",
    "--layers",
    "2",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--hidden",
    "64",
    "--moe-intermediate",
    "32",
]


def test_cli_writes_and_reports(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["synth", str(out), *TINY, "--dtype", "fp16", "--seed", "5", "--shard-size", "64KiB"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "qwen3_moe" in text and "fp16" in text and "MiB/s" in text
    assert "expert bytes 192.0 KiB" in text  # 2 layers x 8 experts x 3 x 64 x 32 x 2 bytes
    marker = json.loads((out / "moestream_synth.json").read_text())
    assert marker["synthetic"] is True and marker["seed"] == 5 and marker["dtype"] == "fp16"
    assert (out / "model.safetensors.index.json").exists()


def test_vocab_size_option(tmp_path, capsys):
    from transformers import AutoConfig

    assert main(["synth", str(tmp_path / "v"), *TINY, "--vocab-size", "4096"]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "v").vocab_size == 4096


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            [
                "--arch",
                "llama",
                "--layers",
                "2",
                "--experts",
                "8",
                "--top-k",
                "2",
                "--hidden",
                "64",
                "--moe-intermediate",
                "32",
            ],
            "unknown architecture 'llama'",
        ),
        (["--preset", "qwen9"], "unknown preset 'qwen9'"),
        (
            ["--arch", "qwen3_moe", "--layers", "2"],
            "missing: --experts, --top-k, --hidden, --moe-intermediate",
        ),
        (
            [*TINY[:-6], "--top-k", "9", "--hidden", "64", "--moe-intermediate", "32"],
            "--top-k 9 is more than the 8",
        ),
        ([*TINY, "--shard-size", "lots"], "--shard-size must be a byte size"),
        ([*TINY, "--shard-size", "0"], "--shard-size must be larger than zero"),
        ([*TINY[:2], "--layers", "two", *TINY[4:]], "--layers must be an integer"),
        ([*TINY[:2], "--layers", "0", *TINY[4:]], "--layers must be a positive integer"),
        ([*TINY, "--dtype", "int8"], "unknown dtype 'int8'"),
        ([*TINY, "--vocab-size", "100"], "vocab size 100 is smaller than the"),
        ([*TINY, "--mxfp4"], "--mxfp4 is the gpt_oss expert format"),
        (["--preset", "gpt-oss-20b", "--hidden", "2000", "--mxfp4"], "multiples of 32"),
        (["--preset", "gpt-oss-20b", "--arch", "mixtral"], "is a gpt_oss model, not mixtral"),
    ],
)
def test_user_errors_are_one_sentence(argv, message, tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("moestream: error: ") and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_non_empty_out_dir_needs_force(tmp_path, capsys):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["synth", str(out), *TINY]) == 2
    assert "not empty (use --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["synth", str(out), *TINY, "--force"]) == 0
    assert not (out / "keep.txt").exists()


def test_presets_and_overrides():
    q = resolve_spec(preset="qwen3-30b-a3b")
    assert (q.arch, q.hidden, q.layers, q.experts, q.top_k, q.moe_intermediate) == (
        "qwen3_moe",
        2048,
        48,
        128,
        8,
        768,
    )
    assert (q.heads, q.kv_heads, q.head_dim) == (32, 4, 128)
    o = resolve_spec(preset="olmoe-1b-7b")
    assert (o.arch, o.hidden, o.layers, o.experts, o.top_k, o.moe_intermediate) == (
        "olmoe",
        2048,
        16,
        64,
        8,
        1024,
    )
    g = resolve_spec(preset="gpt-oss-20b", layers=4, experts=8)
    assert (g.arch, g.hidden, g.layers, g.experts, g.top_k, g.moe_intermediate) == (
        "gpt_oss",
        2880,
        4,
        8,
        4,
        2880,
    )
    d = PRESETS["demo"]
    demo_bytes = d.layers * d.experts * 3 * d.hidden * d.moe_intermediate * 2
    assert 0.9 * 2**30 <= demo_bytes <= 1.1 * 2**30
    small = resolve_spec(preset="qwen3-30b-a3b", hidden=256)  # new hidden: attention derived again
    assert small.heads is None and small.head_dim is None
    with pytest.raises(MoestreamError):
        resolve_spec(preset="demo", top_k=65)


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer()
    assert 900 <= len(tok) <= 1024
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in (
        "The morning train leaves at 7:15.",
        "오늘 아침에는 비가 조금 내렸지만",
        "mixed 日本語 🙂\n\ttabs  x",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        ids = loaded(text)["input_ids"]
        assert loaded.decode(ids) == text
    assert loaded.eos_token == "<|endoftext|>" and loaded.convert_tokens_to_ids("<|im_end|>") == 2
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.chat_template == CHAT_TEMPLATE
    english = loaded("The orchard fills with people every autumn.")["input_ids"]
    assert len(english) < 20  # merges learned: far fewer tokens than the 44 bytes
