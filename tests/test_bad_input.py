"""A user's mistake, made as a hostile or unlucky user makes it: one sentence naming the thing, exit 2,
no traceback."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from moestream.cli import main


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse refuses with exit 2 and its usage line
        code = exc.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def _generate(capsys, ckpt: Path, *extra) -> tuple[int, str]:
    code, _, err = _cli(capsys, "generate", ckpt, "--prompt", "Hello there", "--max-tokens", "3", *extra)
    return code, err


def _rewrite_header(shard: Path, mutate) -> None:
    """Apply `mutate` to a safetensors file's JSON header, keeping the data section as it is."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
NEIGHBOUR = "model.layers.1.mlp.experts.4.up_proj.weight"


def _negative(h):
    begin, end = h[EXPERT]["data_offsets"]
    h[EXPERT]["data_offsets"] = [-8, end - begin - 8]


def _overlapping(h):
    begin, end = h[NEIGHBOUR]["data_offsets"]
    h[EXPERT]["data_offsets"] = [begin + 4, end + 4]


def _negative_dims(h):
    h[EXPERT]["shape"] = [-h[EXPERT]["shape"][0], -h[EXPERT]["shape"][1]]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_negative, "offsets -8.."),
        (_overlapping, f"{NEIGHBOUR} (bytes"),
        (_negative_dims, "shape [-32, -64]"),
    ],
)
def test_bad_header_offsets_are_refused_naming_the_tensor(capsys, tiny_dir, tmp_path, mutate, message):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    _rewrite_header(ckpt / "model.safetensors", mutate)
    code, err = _generate(capsys, ckpt)
    assert code == 2 and "corrupt safetensors header" in err and message in err and EXPERT in err


def test_config_that_is_not_json(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"model_type": "qwen3_moe",')
    code, err = _generate(capsys, ckpt)
    assert code == 2 and f"{ckpt / 'config.json'} is not valid JSON" in err and "line 1" in err


def test_config_field_of_the_wrong_type(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    code, err = _generate(capsys, ckpt)
    assert code == 2 and "cannot read the config" in err and "hidden_size" in err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 128}, "has shape [64, 32], but config.json (hidden_size 128"),  # experts first
        ({"vocab_size": 400}, "has shape [320, 64], but config.json implies [400, 64]"),  # then the trunk
        ({"num_experts_per_tok": 100}, "num_experts_per_tok to 100, outside 1..8"),
    ],
)
def test_config_that_disagrees_with_the_tensors(capsys, tiny_dir, tmp_path, change, message):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **change}))
    code, err = _generate(capsys, ckpt)
    assert code == 2 and message in err


@pytest.mark.parametrize(
    "index, message",
    [
        ({"weight_map": ["model.safetensors"]}, "its weight_map must map tensor names to shard file names"),
        ({"weight_map": {"lm_head.weight": 3}}, "its weight_map must map tensor names to shard file names"),
        ({"metadata": {}}, "it has no weight_map"),
        ([1, 2], "not a valid safetensors index"),
    ],
)
def test_index_whose_weight_map_is_not_an_object(capsys, tiny_dir, tmp_path, index, message):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _generate(capsys, ckpt)
    assert code == 2 and message in err
    assert "model.safetensors.index.json is not a valid safetensors index" in err


def test_garbage_tokenizer(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_bytes(b"\x00garbage{{")
    code, err = _generate(capsys, ckpt)
    assert code == 2 and f"the tokenizer files in {ckpt} cannot be loaded" in err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temperature", "nan", "temperature must be a finite number >= 0, got nan"),
        ("--temperature", "inf", "temperature must be a finite number >= 0, got inf"),
        ("--top-p", "nan", "top_p must be in (0, 1], got nan"),
        ("--seed", str(2**70), "seed must fit in 64 bits"),
        ("--io-threads", "100000", "io threads must be between 1 and 256"),
    ],
)
def test_bad_sampling_and_engine_numbers(capsys, tmp_path, flag, value, message):
    # refused before the model loads: the checkpoint path is never looked at
    code, err = _generate(capsys, tmp_path / "never-read", flag, value)
    assert code == 2 and message in err


def test_tiny_temperature_is_greedy_not_a_crash(capsys, tiny_dir):
    code, out, _ = _cli(
        capsys,
        "generate",
        tiny_dir("qwen3_moe"),
        "--prompt",
        "Hello",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    )
    greedy = json.loads(out)["tokens"]
    code, out, _ = _cli(
        capsys,
        "generate",
        tiny_dir("qwen3_moe"),
        "--prompt",
        "Hello",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--temperature",
        "1e-40",
        "--seed",
        "5",
    )
    assert code == 0 and json.loads(out)["tokens"] == greedy


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_port_out_of_range(capsys, tmp_path, port):
    code, _, err = _cli(capsys, "serve", tmp_path / "never-read", "--port", port)
    assert code == 2 and "argument --port" in err


def test_prompt_past_the_context(capsys, tiny_dir):
    """The tiny models are trained for 256 positions (max_position_embeddings)."""
    code, err = _generate(capsys, tiny_dir("qwen3_moe"), "--prompt", "hello world " * 200)
    assert code == 2 and "more than the model's context of 256 tokens leaves room for (at most 255)" in err
    code, _, err = _cli(capsys, "generate", tiny_dir("qwen3_moe"), "--prompt", "Hello", "--max-tokens", "300")
    assert code == 2 and "max tokens 300 plus the prompt's" in err and "context of 256 tokens" in err


@pytest.fixture(scope="module")
def trace_jsonl(tmp_path_factory) -> Path:
    from moestream.trace import TraceHeader, TraceWriter, load_traces
    from moestream.trace.jsonl import write_jsonl

    out = tmp_path_factory.mktemp("trace")
    with TraceWriter(out / "t.parquet", TraceHeader("m", 2, 8, 2)) as w:
        for token in range(6):
            for layer in range(2):
                w.append(
                    "r",
                    token,
                    "decode",
                    layer,
                    [token % 8, (token + 1) % 8],
                    [0.6, 0.4],
                    pred_experts=[1, 2, 3, 4],
                    pred_scores=[0.4, 0.3, 0.2, 0.1],
                )
    write_jsonl(load_traces([out / "t.parquet"]), out / "t.jsonl")
    return out / "t.jsonl"


def test_prefetch_top_out_of_range(capsys, trace_jsonl):
    code, _, err = _cli(capsys, "simulate", trace_jsonl, "--budgets", "1MiB", "--prefetch-top", "-4")
    assert code == 2 and "--prefetch-top must be at least 1, got -4" in err
    code, _, err = _cli(capsys, "simulate", trace_jsonl, "--budgets", "1MiB", "--prefetch-top", "9")
    assert code == 2 and "exceeds the 4 predicted experts per token the trace holds" in err


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('"experts":[3,4]', '"experts":[3,40]', "expert id 40 at row 6 (request 'r', token 3, layer 0)"),
        ('"experts":[3,4]', '"experts":[-2,4]', "expert id -2 at row 6"),
        ('"layer":1,"step":3', '"layer":5,"step":3', "layer id 5 at row 7"),
        (
            '"pred_experts":[1,2,3,4]',
            '"pred_experts":[1,2,3,99]',
            "predicted expert (pred_experts) id 99 at row 0",
        ),
    ],
)
def test_trace_convert_refuses_out_of_range_ids(capsys, trace_jsonl, tmp_path, old, new, message):
    text = trace_jsonl.read_text()
    assert old in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text.replace(old, new, 1))
    out = tmp_path / "out.parquet"
    code, _, err = _cli(capsys, "trace-convert", bad, out)
    assert code == 2 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing written, nothing left behind


@pytest.mark.parametrize("verb", [["simulate"], ["predict-eval"], ["trace-convert"]])
def test_directory_given_where_a_trace_file_is_expected(capsys, tmp_path, verb):
    extra = [tmp_path / "out.jsonl"] if verb == ["trace-convert"] else []
    code, _, err = _cli(capsys, *verb, tmp_path, *extra)
    assert code == 2 and f"{tmp_path} is a directory, not a trace file" in err


def test_directory_given_where_an_output_file_is_expected(capsys, trace_jsonl, tmp_path):
    (tmp_path / "d.parquet").mkdir()
    code, _, err = _cli(capsys, "trace-convert", trace_jsonl, tmp_path / "d.parquet")
    assert code == 2 and "is a directory; name a file in it instead" in err
    code, _, err = _cli(capsys, "simulate", trace_jsonl, "--budgets", "1MiB", "--plot", tmp_path)
    assert code == 2 and "the plot output" in err and "is a directory" in err
    code, _, err = _cli(
        capsys, "generate", tmp_path / "never-read", "--prompt", "x", "--trace", tmp_path / "d.parquet"
    )
    assert code == 2 and "the trace output" in err and "is a directory" in err
    code, _, err = _cli(
        capsys,
        "generate",
        tmp_path / "never-read",
        "--prompt",
        "x",
        "--trace",
        tmp_path / "missing" / "t.parquet",
    )
    assert code == 2 and f"the directory {tmp_path / 'missing'} does not exist" in err


def test_a_single_shard_under_another_name_loads(capsys, tiny_dir, tmp_path):
    """transformers alone would find no weights unless the one file is model.safetensors; the source
    reads every *.safetensors, so the tokens are those of the original."""
    args = ["--prompt", "Hello", "--max-tokens", "4", "--json"]
    code, out, _ = _cli(capsys, "generate", tiny_dir("qwen3_moe"), *args)
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    (ckpt / "model.safetensors").rename(ckpt / "weights.safetensors")
    code2, out2, _ = _cli(capsys, "generate", ckpt, *args)
    assert code == code2 == 0 and json.loads(out2)["tokens"] == json.loads(out)["tokens"]


def test_generation_config_that_is_not_json(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text("{nope")
    code, err = _generate(capsys, ckpt)
    assert code == 2 and "generation_config.json is not valid JSON" in err
