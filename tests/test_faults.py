"""Fault injection: the checkpoint changing under a running engine, a full disk under a trace, signals.

Bounded (tiny models, a 64 KiB tmpfs, seconds per case) and local only. Each case says what happened
before the fix in its docstring; the oracle is a clean run of the same model (same tokens, same rows).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import moestream
from moestream.cli import main
from moestream.errors import CheckpointChangedError
from moestream.io.memory import AlignedBuffer
from moestream.io.reader import Reader, Request
from moestream.store.safetensors_file import read_header
from moestream.trace import TraceError, partial_path, read_trace

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello there, how are you?"


def _load(ckpt: Path, **options) -> moestream.Engine:
    return moestream.load(str(ckpt), cache="1MiB", io_mode="pagecache", **options)


def _greedy(engine: moestream.Engine, n: int = 12) -> list[int]:
    return engine.generate(PROMPT, max_tokens=n, ignore_eos=True).tokens


# --- a checkpoint changed under a running engine --------------------------------------------------


def _expert(shard: Path, needle: str = "layers.1.mlp.experts.5.down_proj"):
    return next(r for n, r in read_header(shard).items() if needle in n)


def _flip(shard: Path) -> None:
    """Overwrite one expert's bytes in place, same size (what a re-download over the old file does)."""
    ref = _expert(shard)
    with open(shard, "r+b") as f:
        f.seek(ref.offset)
        data = f.read(ref.nbytes)
        f.seek(ref.offset)
        f.write(bytes(b ^ 0x40 for b in data))


def _replace(shard: Path) -> None:
    """A new file renamed over the old one (an atomic re-download), every routed expert's bytes in it
    different: an engine that read it would give other tokens."""
    data = bytearray(shard.read_bytes())
    for name, ref in read_header(shard).items():
        if ".mlp.experts." in name:
            data[ref.offset : ref.offset + ref.nbytes] = bytes(
                b ^ 0x40 for b in data[ref.offset : ref.offset + ref.nbytes]
            )
    tmp = shard.with_name(shard.name + ".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, shard)


@pytest.mark.parametrize(
    "change, says",
    [
        (_flip, "it was modified"),
        (lambda shard: os.truncate(shard, _expert(shard).offset), "its size changed from"),
    ],
)
def test_checkpoint_changed_between_requests_is_named(tiny_dir, tmp_path, change, says):
    """Before: experts overwritten in place changed the output of the next request, exit 0."""
    ckpt = shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    with _load(ckpt) as engine:
        first = _greedy(engine)
        assert _greedy(engine) == first  # unchanged file: no error, same tokens
        change(ckpt / "model.safetensors")
        with pytest.raises(CheckpointChangedError) as info:
            engine.generate(PROMPT, max_tokens=4)
    message = str(info.value)
    assert f"checkpoint file {ckpt / 'model.safetensors'} changed since it was opened" in message
    assert says in message


@pytest.mark.parametrize(
    "change, says",
    [
        (_replace, "was replaced on disk (another file is in its place)"),
        (lambda shard: shard.unlink(), "was removed from disk"),
    ],
)
def test_checkpoint_replaced_between_requests_serves_the_file_it_opened(tiny_dir, tmp_path, change, says):
    """A shard replaced by rename (how huggingface_hub writes) or removed keeps its bytes under the
    descriptor the engine holds: the next requests give the same tokens, from the cold cache too, and
    the engine says so once. Before: every later request failed with "changed since it was opened"."""
    ckpt = shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    shard = ckpt / "model.safetensors"
    with _load(ckpt) as engine:
        first = _greedy(engine)
        change(shard)
        with pytest.warns(RuntimeWarning) as said:
            assert _greedy(engine) == first
        notice = f"checkpoint file {shard} {says} since it was opened"
        assert [str(w.message) for w in said if notice in str(w.message)] == engine.notices
        assert len(engine.notices) == 1 and "a restart" in engine.notices[0]
        engine.restream(preload=False)  # a new reader, every expert read again: from the opened file
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once: not again
            assert _greedy(engine) == first
        assert len(engine.notices) == 1


def test_a_read_that_fails_because_the_file_shrank_says_so(tiny_dir, tmp_path):
    """The read error itself names the change (a file truncated while a request is running)."""
    shard = shutil.copy(tiny_dir("qwen3_moe") / "model.safetensors", tmp_path / "s.safetensors")
    reader = Reader("pagecache", threads=1)
    try:
        handle = reader.open(str(shard))
        os.truncate(shard, 8192)
        buffer = AlignedBuffer(65536)
        done: list[BaseException | None] = []
        event = threading.Event()
        reader.submit(
            [
                Request(
                    priority=(0,),
                    seq=reader.next_seq(),
                    file=handle,
                    offset=16384,
                    length=65536,
                    needed=65536,
                    dest=buffer.view,
                    dest_address=buffer.address,
                    piece=65536,
                    on_done=lambda err: (done.append(err), event.set()),
                )
            ]
        )
        assert event.wait(30)
    finally:
        reader.close()
    assert isinstance(done[0], CheckpointChangedError)
    assert "its size changed from" in str(done[0]) and "to 8192 bytes" in str(done[0])


# --- a full disk under the trace ----------------------------------------------------------------


@contextlib.contextmanager
def _small_fs(where: Path, size: str = "64k", free: int = 0) -> Iterator[Path]:
    """A real tmpfs of `size`, filled until `free` bytes are left (root only: mount)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        if free is not None:
            st = os.statvfs(where)
            fill = st.f_bavail * st.f_frsize - free
            with open(where / "filler", "wb") as f:
                f.write(b"\0" * max(0, fill))
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_disk_full_mid_generation_keeps_generating_and_says_what_was_kept(tiny_dir, tmp_path):
    """Before: ENOSPC from a trace flush came out of a layer forward: the generation died with it."""
    ckpt = tiny_dir("qwen3_moe")
    with _load(ckpt) as engine:
        engine.start_trace(tmp_path / "full.parquet")
        clean = _greedy(engine, 40)
        engine.stop_trace()
        with _small_fs(tmp_path / "fs", free=12 * 1024) as fs:
            engine.start_trace(fs / "t.parquet")
            engine.recorder.writer.flush_rows = 16  # batches go out during the request, not only at its end
            assert _greedy(engine, 40) == clean  # the generation is untouched by the failing trace
            with pytest.raises(TraceError) as info:
                engine.stop_trace()
            kept = read_trace(fs / "t.parquet")  # from the stream, up to its last complete batch
            leftovers = sorted(p.name for p in fs.iterdir())
        assert _greedy(engine, 4) == clean[:4]  # and the engine serves the next request
    message = str(info.value)
    assert "No space left on device" in message and "recording stopped" in message
    assert "t.parquet.partial" in message
    assert leftovers == ["filler", "t.parquet.partial"]
    full = read_trace(tmp_path / "full.parquet")
    assert 0 < len(kept) < len(full)
    assert kept.experts.tolist() == full.experts[: len(kept)].tolist()  # what was kept is exactly right


def test_disk_full_in_the_cli_prints_the_text_then_one_error(capsys, tiny_dir, tmp_path):
    args = [
        "generate",
        str(tiny_dir("qwen3_moe")),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "60",
        "--ignore-eos",
        "--cache",
        "1MiB",
    ]
    assert main(args) == 0
    clean = capsys.readouterr().out.splitlines()
    with _small_fs(tmp_path / "fs", free=4096) as fs:
        code = main([*args, "--trace", str(fs / "t.parquet")])
        leftovers = sorted(p.name for p in fs.iterdir())
    out = capsys.readouterr()
    assert code == 2
    assert out.out.splitlines() == clean  # the text (the mode line is on stderr), as without a trace
    errors = [line for line in out.err.splitlines() if line.startswith("moestream: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "Traceback" not in out.err
    assert not [name for name in leftovers if name.endswith(".tmp")]


def test_trace_convert_onto_a_full_disk_leaves_nothing_behind(capsys, tmp_path):
    from moestream.trace import TraceHeader, TraceWriter

    src = tmp_path / "src.parquet"
    with TraceWriter(src, TraceHeader("m", 2, 64, 8)) as w:
        for token in range(400):
            for layer in range(2):
                experts = [(token * 7 + i * 5 + layer) % 64 for i in range(8)]
                w.append("r", token, "decode", layer, experts, [0.125] * 8)
    for suffix in (".jsonl", ".parquet"):
        with _small_fs(tmp_path / f"fs{suffix}", free=8192) as fs:
            code = main(["trace-convert", str(src), str(fs / f"out{suffix}")])
            leftovers = sorted(p.name for p in fs.iterdir())
        err = capsys.readouterr().err
        assert code == 2 and "No space left on device" in err and "Traceback" not in err, err
        assert leftovers == ["filler"]  # no half file under the final name, no temporary file


# --- signals ------------------------------------------------------------------------------------


def _long_context_copy(tiny: Path, dst: Path) -> Path:
    ckpt = shutil.copytree(tiny, dst)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 100_000}))
    return ckpt


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_generate_finishes_the_trace(tiny_dir, tmp_path, sig, code):
    """Before: SIGTERM killed the process at once; rows not yet flushed (up to 4096) were lost and the
    trace stayed a .partial stream. SIGINT already finished it."""
    ckpt = _long_context_copy(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
    trace = tmp_path / "t.parquet"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moestream",
            "generate",
            str(ckpt),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "90000",
            "--ignore-eos",
            "--cache",
            "1MiB",
            "--trace",
            str(trace),
            "--ctx-size",
            "100000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # a foreground run's SIGINT: a child of a background job (a suite started under nohup) would
        # inherit it ignored, and Python then never raises KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = child.stderr.readline()
        while line.startswith("moestream: warning:"):
            line = child.stderr.readline()
        assert line.startswith("moestream: qwen3_moe")  # the mode line (on stderr): generating now
        time.sleep(1.0)
        child.send_signal(sig)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == code and "Traceback" not in err, err
    assert trace.exists() and not partial_path(trace).exists()
    t = read_trace(trace)
    decode = t.token[t.phase == 1]
    assert len(decode) > 0
    assert sorted(set(decode.tolist())) == list(range(int(decode.min()), int(decode.max()) + 1))
