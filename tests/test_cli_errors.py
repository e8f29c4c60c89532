"""Bad input: one sentence naming the file or tensor, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import transformers as T
from safetensors.torch import load_file, save_file

from moestream.cli import main


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shard(path: Path) -> None:
    """Split model.safetensors into two shards with an index, like save_pretrained does for big models."""
    sd = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    keys = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: sd[k] for k in part}, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(["generate", *map(str, argv), "--prompt", "Hello", "--max-tokens", "3"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_missing_path(capsys, tmp_path):
    code, err = _run(capsys, tmp_path / "nope")
    assert code == 2 and f"checkpoint directory {tmp_path / 'nope'} does not exist" in err


def test_sharded_checkpoint_generates_and_missing_shard_is_named(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "sharded")
    _shard(ckpt)
    assert main(["generate", str(ckpt), "--prompt", "Hello", "--max-tokens", "3", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)["tokens"]
    assert (
        main(["generate", str(tiny_dir("qwen3_moe")), "--prompt", "Hello", "--max-tokens", "3", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["tokens"] == sharded
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    code, err = _run(capsys, ckpt)
    assert code == 2 and "model-00002-of-00002.safetensors" in err and "missing" in err


def test_truncated_shard_names_the_tensor(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "trunc")
    shard = ckpt / "model.safetensors"
    from moestream.store.safetensors_file import read_header

    expert = next(r for n, r in read_header(shard).items() if ".experts.5.up_proj" in n and "layers.1" in n)
    os.truncate(shard, expert.offset + 100)  # EOF inside an expert
    code, err = _run(capsys, ckpt)
    assert code == 2 and "is truncated" in err and "experts.5.up_proj" in err


def test_corrupt_header(capsys, tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir("qwen3_moe"), tmp_path / "corrupt")
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    code, err = _run(capsys, ckpt)
    assert code == 2 and "corrupt safetensors header" in err and "model.safetensors" in err


def test_dense_model_is_refused_naming_model_type(capsys, tmp_path):
    config = T.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    T.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dense")
    code, err = _run(capsys, tmp_path / "dense")
    assert code == 2 and "model_type 'llama' is not a supported Mixture-of-Experts architecture" in err


def test_cache_too_small(capsys, tiny_dir):
    code, err = _run(capsys, tiny_dir("qwen3_moe"), "--cache", "1KiB")
    assert code == 2 and "below one layer's worst case" in err and "72.0 KiB" in err


def test_bad_size_and_options(capsys, tiny_dir):
    code, err = _run(capsys, tiny_dir("qwen3_moe"), "--cache", "lots")
    assert code == 2 and "not a byte size: 'lots'" in err
    code, err = _run(capsys, tiny_dir("qwen3_moe"), "--piece", "1000")
    assert code == 2 and "multiple of 4 KiB" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch the file-system user")
def test_unreadable_file(capsys, tiny_dir):
    """As another file-system user (setfsuid drops root's override of permissions), a 0600 shard."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    base = Path(tempfile.mkdtemp(prefix="moestream-perm-"))
    try:
        os.chmod(base, 0o755)
        ckpt = _copy(tiny_dir("qwen3_moe"), base / "ckpt")
        os.chmod(ckpt, 0o755)
        for f in ckpt.iterdir():
            os.chmod(f, 0o644)
        os.chmod(ckpt / "model.safetensors", 0o600)
        libc.setfsuid(65534)
        try:
            code, err = _run(capsys, ckpt)
        finally:
            libc.setfsuid(0)
        assert code == 2 and "model.safetensors is not readable (permission denied)" in err
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_filesystem_without_o_direct_falls_back_to_pagecache(capsys, tiny_dir, monkeypatch):
    """Some file systems (older tmpfs, many FUSE mounts) refuse O_DIRECT with EINVAL, at open and when
    it is set on an open file (fcntl F_SETFL: how a reader's descriptor, a duplicate of the one held
    since load, gets it). This kernel's tmpfs accepts it, so the refusal is faked at the system-call
    boundary."""
    import errno
    import fcntl

    import moestream.io.reader as reader_module

    real_fcntl = fcntl.fcntl

    def no_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    ckpt = tiny_dir("qwen3_moe")
    assert main(["generate", str(ckpt), "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(reader_module.fcntl, "fcntl", no_direct)
    assert main(["generate", str(ckpt), "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    out = capsys.readouterr()
    assert "refuses O_DIRECT" in out.err and "page cache" in out.err
    fallen_back = json.loads(out.out)
    assert "io pagecache (fallback" in fallen_back["mode"]
    assert fallen_back["tokens"] == direct["tokens"]
