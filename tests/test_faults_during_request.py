"""Fault injection: expert bytes changed under a request while it runs, in every io mode; and a shard
replaced by rename under it, which the engine serves on from the file it opened.

Each change happens at a point the test controls (between two tokens: after `Engine.stream` has
yielded the k-th token and before it is asked for the next), so nothing depends on timing. The oracle is
a clean request of the same engine: the tokens presented before the error are exactly its first k, and
the request after the file is restored gives all of its tokens again.

Before: an in-place overwrite (what `dd conv=notrunc` does) or a `cp` of another checkpoint over the
shard gave different text and exit status 0 in `--io-mode direct` and `mmap`; the files were checked
before each request and when a read failed, not during a request.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import moestream
from moestream.cli import main
from moestream.engine.engine import Engine
from moestream.engine.sampling import SamplingParams
from moestream.errors import CheckpointChangedError
from moestream.runtime.experts import LayerRouting
from moestream.server.generation import _failure
from moestream.server.worker import Done, Failed, Job, Token, Worker
from moestream.store.safetensors_file import read_header

PROMPT = [5]  # one prompt token: the cold cache's first forwards still have experts to read
TOKENS = 8
ROUNDS = (1, 3, 6)  # the change comes after this many tokens were presented
MODES = ("direct", "pagecache", "mmap")


class Shard:
    """A copy of the tiny checkpoint, and the ways its one shard is changed under the engine and put back
    as it was opened (its bytes and its mtime: what makes it the opened file again for the check)."""

    def __init__(self, tiny: Path, where: Path) -> None:
        self.ckpt = shutil.copytree(tiny, where / "ckpt")
        self.path = self.ckpt / "model.safetensors"
        self.original = self.path.read_bytes()
        self.experts = [r for name, r in read_header(self.path).items() if ".mlp.experts." in name]
        flipped = np.frombuffer(self.original, dtype=np.uint8).copy()
        for ref in self.experts:  # every routed expert's bytes, nothing else: the trunk stays valid
            flipped[ref.offset : ref.offset + ref.nbytes] ^= 0x40
        self.other = where / "other.safetensors"  # "another checkpoint": same size, other experts
        self.other.write_bytes(flipped.tobytes())
        self.stat = os.stat(self.path)

    def overwrite(self) -> None:
        """Every expert's bytes rewritten in place: same size, same inode (`dd conv=notrunc`)."""
        other = self.other.read_bytes()
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for ref in self.experts:
                os.pwrite(fd, other[ref.offset : ref.offset + ref.nbytes], ref.offset)
        finally:
            os.close(fd)

    def copy_over(self) -> None:
        """Another checkpoint copied over the shard (`cp`: truncated and rewritten, same inode)."""
        shutil.copyfile(self.other, self.path)

    def replace(self) -> None:
        """Another checkpoint written beside the shard, then renamed over it (`os.replace`: how
        huggingface_hub and most download tools write): a new inode at the path, the opened one intact."""
        new = self.path.with_name(self.path.name + ".incomplete")
        shutil.copyfile(self.other, new)
        os.replace(new, self.path)

    def restore(self) -> None:
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        assert os.stat(self.path).st_ino == self.stat.st_ino  # the opened file, not a new one


CHANGES = {"overwrite": Shard.overwrite, "copy_over": Shard.copy_over}


def _changed_at(
    engine: Engine, k: int, change: Callable[[], None], inside: bool
) -> tuple[list[int], str, int]:
    """Run a request and change the shard after its k-th token: between two forwards, or `inside` the
    next forward (at its last MoE layer, once the layers before it have read their experts; a check
    before each forward would miss it). Returns (the tokens presented, the error, experts read since the
    change)."""
    presented: list[int] = []
    stream = engine.stream(PROMPT, max_tokens=TOKENS, ignore_eos=True)
    for gen in stream:
        presented = list(gen.tokens)
        if len(presented) == k:
            break
    misses = engine.counters().misses
    if inside:
        runtime, last = engine.runtime, engine.emap.layers[-1]

        def once(event: LayerRouting) -> None:  # the routing is known, the experts not read yet
            if event.layer == last:
                runtime.observers.remove(once)
                change()

        runtime.observers.append(once)
    else:
        change()
    with pytest.raises(CheckpointChangedError) as info:
        for gen in stream:
            presented = list(gen.tokens)
    return presented, str(info.value), engine.counters().misses - misses


@pytest.mark.parametrize("mode", MODES)
def test_expert_bytes_changed_during_a_request_end_it(tiny_dir, tmp_path, mode):
    """Both changes, between two forwards and inside one, after 1, 3 and 6 tokens: 12 per engine."""
    shard = Shard(tiny_dir("qwen3_moe"), tmp_path)
    read_changed = 0
    # a cache that holds every expert: bytes read while the file was changed would stay in it
    with moestream.load(str(shard.ckpt), cache="1MiB", io_mode=mode) as engine:
        clean = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens
        engine.restream(preload=False)  # cold again: the rounds' forwards read experts
        for name, change in CHANGES.items():
            for inside in (False, True):
                for k in ROUNDS:
                    case = (name, "inside" if inside else "between", k)
                    presented, error, read = _changed_at(engine, k, lambda c=change: c(shard), inside)
                    read_changed += read
                    # no token computed from the changed bytes was presented
                    assert presented == clean[:k], case
                    # the same one line as the check before a request
                    with pytest.raises(CheckpointChangedError) as before:
                        engine.generate(PROMPT, max_tokens=2)
                    assert error == str(before.value) and "\n" not in error, case
                    assert error.startswith(
                        f"checkpoint file {shard.path} changed since it was opened (it was modified)"
                    )
                    shard.restore()
                    assert engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens == clean, case
    # experts were read from the changed file and kept in the cache: the clean requests after the
    # restores show none of them was served again
    assert read_changed > 0


REPLACED = "was replaced on disk (another file is in its place) since it was opened"
SMALL_CACHE = "144KiB"  # 4 of the tiny model's 16 expert slots: every token reads experts


@pytest.mark.parametrize("inside", [False, True], ids=["between", "inside"])
@pytest.mark.parametrize("mode", MODES)
def test_a_shard_replaced_by_rename_during_a_request_is_served_from_the_opened_file(
    tiny_dir, tmp_path, mode, inside
):
    """The shard is replaced after 3 tokens (between two forwards, or inside the next one once its
    routing is known) by a file whose every expert differs: the request goes on with the tokens of a
    clean run, experts are read after the replacement (a cache of 4 slots), a restream reads them all
    again from the opened file, and the engine says it once. Before: that request and every later one
    failed with "changed since it was opened"."""
    shard = Shard(tiny_dir("qwen3_moe"), tmp_path)
    with moestream.load(str(shard.ckpt), cache=SMALL_CACHE, io_mode=mode) as engine:
        clean = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens
        stream = engine.stream(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        presented = next(gen.tokens for gen in stream if len(gen.tokens) == 3)
        misses = engine.counters().misses
        if inside:
            runtime, last = engine.runtime, engine.emap.layers[-1]

            def once(event: LayerRouting) -> None:
                if event.layer == last:
                    runtime.observers.remove(once)
                    shard.replace()

            runtime.observers.append(once)
        else:
            shard.replace()
        with pytest.warns(RuntimeWarning) as said:
            for gen in stream:
                presented = list(gen.tokens)
        assert os.stat(shard.path).st_ino != shard.stat.st_ino  # the path names the new file
        assert presented == clean
        assert engine.counters().misses > misses  # experts were read after the replacement
        notice = (
            f"checkpoint file {shard.path} {REPLACED}; moestream goes on computing with the file it opened"
        )
        assert [str(w.message) for w in said] == engine.notices and engine.notices[0].startswith(notice)
        engine.restream(preload=False)  # a new reader: reopened from the held file, not the path
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens == clean
        assert len(engine.notices) == 1
    with moestream.load(str(shard.ckpt), cache=SMALL_CACHE, io_mode=mode) as fresh:  # a restart loads it
        assert fresh.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens != clean
        assert fresh.notices == []


def _changing_stream(after: int, change: Callable[[], None]) -> Callable[..., Iterator]:
    """`Engine.stream` that changes the shard once its consumer has had `after` tokens."""
    real = Engine.stream

    def stream(self: Engine, *args, **kwargs) -> Iterator:
        for gen in real(self, *args, **kwargs):
            yield gen
            if len(gen.tokens) == after and not gen.done:
                change()

    return stream


def test_generate_exits_non_zero_with_one_line_when_a_shard_is_copied_over(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    shard = Shard(tiny_dir("qwen3_moe"), tmp_path)
    args = ["generate", str(shard.ckpt), "--prompt", "Hello there", "--max-tokens", str(TOKENS)]
    args += ["--ignore-eos", "--cache", "1MiB", "--io-mode", "direct"]
    assert main(args) == 0
    clean = capsys.readouterr().out
    monkeypatch.setattr(Engine, "stream", _changing_stream(3, shard.copy_over))
    code = main(args)
    out = capsys.readouterr()
    assert code == 2
    errors = [line for line in out.err.splitlines() if line.startswith("moestream: error:")]
    assert len(errors) == 1 and "Traceback" not in out.err
    assert errors[0].startswith(f"moestream: error: checkpoint file {shard.path} changed since it was opened")
    assert clean.startswith(out.out) and out.out  # the tokens before the change, none after


@pytest.mark.parametrize("mode", MODES)
def test_generate_goes_on_with_one_warning_when_a_shard_is_replaced_by_rename(
    tiny_dir, tmp_path, capsys, monkeypatch, mode
):
    shard = Shard(tiny_dir("qwen3_moe"), tmp_path)
    args = ["generate", str(shard.ckpt), "--prompt", "Hello there", "--max-tokens", str(TOKENS)]
    args += ["--ignore-eos", "--cache", SMALL_CACHE, "--io-mode", mode]
    assert main(args) == 0
    clean = capsys.readouterr().out
    monkeypatch.setattr(Engine, "stream", _changing_stream(3, shard.replace))
    code = main(args)
    out = capsys.readouterr()
    assert code == 0 and out.out == clean
    said = [line for line in out.err.splitlines() if line.startswith("moestream: warning:")]
    assert said == [
        f"moestream: warning: checkpoint file {shard.path} {REPLACED}; moestream goes on "
        "computing with the file it opened, whose bytes are unchanged: a restart loads the new file"
    ]
    assert "error" not in out.err


class _ChangeAfter(Job):
    """Changes the shard from the worker thread right after emitting its n-th token."""

    n: int = 3
    change: Callable[[], None]

    def emit(self, event) -> None:
        super().emit(event)
        if isinstance(event, Token) and event.n_tokens == self.n:
            self.change()


async def _events(job: Job) -> list:
    events = []
    while not events or not isinstance(events[-1], Done | Failed):
        events.append(await asyncio.wait_for(job.events.get(), 60))
    return events


def test_the_server_fails_that_request_and_serves_the_next(tiny_dir, tmp_path):
    shard = Shard(tiny_dir("qwen3_moe"), tmp_path)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    with moestream.load(str(shard.ckpt), cache="1MiB", io_mode="direct") as engine:
        clean = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens
        worker = Worker(engine, queue_size=2)
        worker.start()

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            job = _ChangeAfter(PROMPT, params, "a", loop)
            job.change = shard.overwrite
            events = await _events(job_run(job))
            assert [e.n_tokens for e in events if isinstance(e, Token)] == [1, 2, 3]
            assert isinstance(events[-1], Failed) and isinstance(events[-1].error, CheckpointChangedError)
            answer = _failure(events[-1])  # what the client is sent
            assert answer.status == 500 and answer.code == "generation_failed"
            assert "\n" not in answer.message and f"checkpoint file {shard.path} changed" in answer.message
            shard.restore()
            follow = await _events(job_run(Job(PROMPT, params, "b", loop)))
            assert follow[-1].gen.tokens == clean

        def job_run(job: Job) -> Job:
            worker.submit(job)
            return job

        try:
            asyncio.run(scenario())
        finally:
            worker.stop()


def test_the_server_serves_on_and_says_so_in_health_when_a_shard_is_replaced(tiny_dir, tmp_path):
    """A live `moestream serve` (mmap, 4 expert slots: every request reads experts): after a rename over
    its shard, the next requests give the same text, /health says so (still 200, "ok"), and its stderr
    says so once."""
    from test_server_harness import KEY, LiveServer

    shard = Shard(tiny_dir("qwen3_moe"), tmp_path)
    args = ["--cache", SMALL_CACHE, "--io-mode", "mmap", "--api-key", KEY, "--threads", "1"]
    server = LiveServer(shard.ckpt, args)
    body = {"prompt": "Hello there", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        clean = server.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert "notices" not in server.http.get("/health").json()
        shard.replace()
        for _ in range(2):
            res = server.http.post("/v1/completions", json=body)
            assert res.status_code == 200 and res.json()["choices"][0]["text"] == clean
        health = server.http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert len(health.json()["notices"]) == 1
        assert health.json()["notices"][0].startswith(f"checkpoint file {shard.path} {REPLACED}")
        said = [line for line in server.log_text().splitlines() if REPLACED in line]
        assert len(said) == 1 and said[0].startswith("moestream: warning: checkpoint file")
    finally:
        server.stop()
