"""Models by name (`-hf REPO[:QUANT]`): fetched from a fake hub on 127.0.0.1 into a temporary HF cache,
then opened exactly as the local files are. No internet: huggingface_hub's endpoint is the fake hub."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import checkpoint_files, hub_serving
from gguf import GGMLQuantizationType as Q

from moestream.cli import main
from moestream.errors import CheckpointError
from moestream.store.hub import fetch
from moestream.store.hub_select import parse_spec, select_files

MiB = 1 << 20
GEN = ["--prompt", "Hello", "--max-tokens", "4", "--cache", "64MiB", "--json"]


def _files(*paths: Path, under: str = "") -> dict[str, bytes]:
    return {under + p.name: p.read_bytes() for p in paths}


@pytest.fixture(scope="module")
def models(tiny_gguf, tiny_dir, tmp_path_factory):
    """Local checkpoints and the repositories that serve them: a GGUF repo with two quants, one with a
    split GGUF in a folder, and a safetensors repo."""
    from tiny_gguf import write_gguf

    hf, f32 = tiny_gguf("qwen3_moe")
    _, q8 = tiny_gguf("qwen3_moe", ftype=Q.Q8_0)
    root = tmp_path_factory.mktemp("split")
    first = write_gguf(hf, root / "moe-F32.gguf", split_max_tensors=12)
    parts = sorted(root.glob("moe-F32-*-of-*.gguf"))
    assert first == parts[0] and len(parts) >= 2
    st = tiny_dir("qwen3_moe")
    repos = {
        "tiny/moe-GGUF": {
            "moe-Q8_0.gguf": q8.read_bytes(),
            "moe-F32.gguf": f32.read_bytes(),
            "README.md": b"#",
        },
        "tiny/moe-split-GGUF": {**_files(*parts, under="F32/"), "README.md": b"# split\n"},
        "tiny/moe": {**checkpoint_files(st), "README.md": b"# hf\n"},
    }
    return {"q8": q8, "split": first, "safetensors": st, "repos": repos}


@pytest.fixture
def hub(models, tmp_path):
    with hub_serving(models["repos"], tmp_path / "hf-cache") as fake:
        yield fake


def _generate(capsys, *model: str) -> list[int]:
    capsys.readouterr()
    assert main(["generate", *model, *GEN]) == 0
    return json.loads(capsys.readouterr().out)["tokens"]


def _info(capsys, *model: str) -> dict:
    capsys.readouterr()
    assert main(["info", *model, "--no-routing", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    return {k: v for k, v in info.items() if k != "path"}


def _error(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_quant_is_downloaded_once_and_runs_as_the_local_file(hub, models, capsys):
    assert _info(capsys, "-hf", "tiny/moe-GGUF:Q8_0") == _info(capsys, str(models["q8"]))
    assert _info(capsys, "--hf-repo", "tiny/moe-GGUF:q8_0")["formats"] == ["Q8_0"]  # any case
    assert _generate(capsys, "-hf", "tiny/moe-GGUF:Q8_0") == _generate(capsys, str(models["q8"]))
    assert len(hub.gets("moe-Q8_0.gguf")) == 1  # then from the cache, after one look at the listing
    assert len([r for r in hub.requests if r[0] == "HEAD"]) == 1
    assert hub.gets("moe-F32.gguf") == [] and hub.gets("README.md") == []
    # PATH (and the Python API) take a model by name too
    assert _generate(capsys, "tiny/moe-GGUF:Q8_0") == _generate(capsys, str(models["q8"]))


def test_a_split_gguf_downloads_every_part(hub, models, capsys):
    path = fetch("tiny/moe-split-GGUF")  # one model in the repo: no quant needed
    parts = sorted(n for n in models["repos"]["tiny/moe-split-GGUF"] if n.endswith(".gguf"))
    assert path.name == Path(parts[0]).name and path.parent.name == "F32"
    assert sorted(p.name for p in path.parent.iterdir()) == [Path(n).name for n in parts]
    assert _generate(capsys, "-hf", "tiny/moe-split-GGUF:F32") == _generate(capsys, str(models["split"]))


def test_a_repository_without_gguf_gives_its_safetensors_checkpoint(hub, models, capsys):
    path = fetch("tiny/moe")
    assert path.is_dir() and (path / "config.json").is_file() and not (path / "README.md").exists()
    assert _generate(capsys, "-hf", "tiny/moe") == _generate(capsys, str(models["safetensors"]))
    assert "no quant Q8_0" in _error(capsys, "info", "-hf", "tiny/moe:Q8_0", "--no-routing")


def test_a_dropped_connection_resumes_where_it_stopped(hub):
    data = os.urandom(12 * MiB)
    hub.add("tiny/big-GGUF", {"big-Q8_0.gguf": data})
    hub.drop_once["big-Q8_0.gguf"] = 11 * MiB
    path = fetch("tiny/big-GGUF")
    assert path.read_bytes() == data
    # huggingface_hub writes in 10 MiB chunks: the resumed request asks for the rest of the file
    assert hub.gets("big-Q8_0.gguf") == [None, f"bytes={10 * MiB}-"]


def test_a_download_stopped_with_its_process_resumes_in_the_next(hub):
    data = os.urandom(12 * MiB)
    hub.add("tiny/big-GGUF", {"big-Q8_0.gguf": data})
    hub.stall["big-Q8_0.gguf"] = 11 * MiB  # then the connection hangs until the process is killed
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": hub_cache(), "HF_HUB_DISABLE_XET": "1"}
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "0"
    code = "import sys; from moestream.store.hub import fetch; fetch(sys.argv[1])"
    first = subprocess.Popen([sys.executable, "-c", code, "tiny/big-GGUF"], env=env, stderr=subprocess.PIPE)
    part = Path(hub_cache()) / "models--tiny--big-GGUF" / "blobs" / f"{hashlib.sha256(data).hexdigest()}.part"
    deadline = time.monotonic() + 120
    while not (part.exists() and part.stat().st_size >= 10 * MiB):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1]
        time.sleep(0.1)
    first.kill()
    first.communicate()
    hub.release.set()
    assert fetch("tiny/big-GGUF").read_bytes() == data
    assert hub.gets("big-Q8_0.gguf") == [None, f"bytes={10 * MiB}-"]
    assert not part.exists()


def test_a_corrupt_download_is_refused_and_removed_from_the_cache(hub, models):
    hub.corrupt.add("moe-Q8_0.gguf")
    with pytest.raises(CheckpointError, match=r"moe-Q8_0.gguf came down corrupt \(sha256"):
        fetch("tiny/moe-GGUF:Q8_0")
    blobs = Path(hub_cache()) / "models--tiny--moe-GGUF" / "blobs"
    assert list(blobs.iterdir()) == []
    hub.corrupt.clear()
    assert fetch("tiny/moe-GGUF:Q8_0").read_bytes() == models["q8"].read_bytes()


def test_a_corrupt_small_file_is_refused_by_its_git_blob_id(hub):
    hub.corrupt.add("config.json")
    with pytest.raises(CheckpointError, match=r"config.json came down corrupt \(git blob id"):
        fetch("tiny/moe")


def test_a_large_file_huggingface_hub_downloaded_is_checked_by_sha256(tmp_path):
    """The check of a file huggingface_hub fetched itself (a Xet file): its blob and link both go."""
    from types import SimpleNamespace

    from moestream.store.hub import _verify

    blob, link = tmp_path / "blobs" / "abc", tmp_path / "snapshot" / "m-Q8_0.gguf"
    blob.parent.mkdir()
    link.parent.mkdir()
    blob.write_bytes(b"what came down")
    link.symlink_to(blob)
    right = hashlib.sha256(b"what came down").hexdigest()
    entry = SimpleNamespace(size=14, blob_id="0" * 40, lfs=SimpleNamespace(sha256=right, size=14))
    _verify(parse_spec("a/b"), link, entry)  # as listed: kept
    entry.lfs.sha256 = "f" * 64
    with pytest.raises(CheckpointError, match=r"m-Q8_0.gguf came down corrupt \(sha256"):
        _verify(parse_spec("a/b"), link, entry)
    assert not blob.exists() and not link.is_symlink()


def test_offline_the_cache_serves_and_a_missing_file_is_one_error(hub, models, capsys, monkeypatch):
    from huggingface_hub import constants

    local = _generate(capsys, str(models["q8"]))
    fetch("tiny/moe-GGUF:Q8_0")
    seen = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert _generate(capsys, "-hf", "tiny/moe-GGUF:Q8_0") == local
    assert len(hub.requests) == seen  # not one request
    err = _error(capsys, "generate", "-hf", "tiny/moe-GGUF:F32", "--prompt", "Hi")
    assert "moe-F32.gguf is not in the HF cache" in err and "HF_HUB_OFFLINE is set" in err
    err = _error(capsys, "generate", "-hf", "tiny/moe", "--prompt", "Hi")
    assert "tiny/moe is not in the HF cache" in err
    # a hub that cannot be reached is offline too
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    assert fetch("tiny/moe-GGUF:Q8_0").is_file()
    err = _error(capsys, "info", "-hf", "tiny/moe-GGUF:F32", "--no-routing")
    assert "not in the HF cache" in err and "cannot be reached" in err


def test_a_quant_matching_several_models_or_none_is_one_error_listing_them(hub, capsys):
    hub.add("tiny/many-GGUF", {"m-Q4_K_M.gguf": b"a", "m-Q4_K_S.gguf": b"b", "m-Q8_0.gguf": b"c"})
    err = _error(capsys, "info", "-hf", "tiny/many-GGUF:Q4_K", "--no-routing")
    assert "matches 2 GGUF models" in err and "m-Q4_K_M.gguf, m-Q4_K_S.gguf" in err
    err = _error(capsys, "info", "-hf", "tiny/many-GGUF:IQ2_XS", "--no-routing")
    assert "no GGUF file for the quant IQ2_XS" in err and "m-Q8_0.gguf" in err
    hub.add("tiny/two-GGUF", {"m-Q5_K_M.gguf": b"a", "m-Q8_0.gguf": b"c"})
    err = _error(capsys, "info", "-hf", "tiny/two-GGUF", "--no-routing")
    assert "none is Q4_K_M (the default)" in err
    assert "has no model repository tiny/nothing" in _error(capsys, "info", "-hf", "tiny/nothing")
    assert "OWNER/REPO" in _error(capsys, "info", "-hf", "not a repo")
    assert "once" in _error(capsys, "generate", "x", "-hf", "tiny/moe", "--prompt", "Hi")


def test_serve_and_bench_take_a_model_by_name(hub, models, capsys, monkeypatch, tmp_path):
    seen = {}

    def serving(server, sock) -> None:  # what `serve` would run, recorded instead
        seen["options"] = server.config.app.state.server.options

    monkeypatch.setattr("moestream.cli.serve._run_until_stopped", serving)
    assert main(["serve", "-hf", "tiny/moe-GGUF:Q8_0", "--port", "0", "--cache", "64MiB"]) == 0
    assert seen["options"].model_id == "tiny/moe-GGUF:Q8_0"  # the id clients use: the name, not a hash
    assert seen["options"].aliases[0].endswith("/moe-Q8_0.gguf")

    def bench(config) -> None:
        seen["bench"] = config
        raise CheckpointError("recorded")

    monkeypatch.setattr("moestream.bench.harness.run_bench", bench)
    main(["bench", "-hf", "tiny/moe", "--out", str(tmp_path / "bench")])
    served = seen["bench"].server_argv
    assert Path(served[served.index("serve") + 1]) == fetch("tiny/moe")  # downloaded before the server starts
    with pytest.raises(SystemExit):  # argparse's own refusal of two models
        main(["bench", "-hf", "tiny/moe", "--target", "http://127.0.0.1:9", "--out", "x"])
    assert "--target: not allowed with argument -hf/--hf-repo" in capsys.readouterr().err


def test_default_quant_split_parts_and_projectors():
    names = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-F16.gguf", "README.md"]
    assert select_files(parse_spec("a/b"), names).open == "m-Q4_K_M.gguf"
    assert select_files(parse_spec("a/b:q8_0"), names).files == ("m-Q8_0.gguf",)
    split = [f"Q4_K_M/m-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)] + ["m-Q8_0.gguf"]
    chosen = select_files(parse_spec("a/b"), split)
    assert chosen.files == tuple(split[:3]) and chosen.open == split[0]
    with pytest.raises(CheckpointError, match=r"lacks Q4_K_M/m-Q4_K_M-00002-of-00003\.gguf"):
        select_files(parse_spec("a/b:Q4_K_M"), [split[0], split[2]])
    with pytest.raises(CheckpointError, match="neither GGUF files nor a safetensors"):
        select_files(parse_spec("a/b"), ["README.md", "model.bin"])


def test_hf_endpoint_and_hf_home_in_the_environment(hub, tmp_path):
    """What a user sets: HF_ENDPOINT and HF_HOME, read by huggingface_hub in a fresh process."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_DISABLE_XET": "1"}
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "0"
    argv = [sys.executable, "-m", "moestream", "info", "-hf", "tiny/moe-GGUF:Q8_0", "--no-routing", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["path"].startswith(
        str(tmp_path / "home" / "hub" / "models--tiny--moe-GGUF")
    )
    assert "downloading moe-Q8_0.gguf of tiny/moe-GGUF" in done.stderr


def hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
