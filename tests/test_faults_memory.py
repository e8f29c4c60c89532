"""Fault injection, memory: the trunk in memory the process owns, a shard shrunk under a running engine,
memory checked before it is taken (a real cgroup v1 limit), and memory given back by close.

Bounded (tiny or 96 MiB synthetic checkpoints, seconds per case) and local only. Cases that must show the
process is not killed by a signal run in a child process and check its exit status.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from memory_limits import v1_memory_root, write_synth96

import moestream
from moestream.engine.memory import MemoryNeed, Room, check_memory, lock_allowed, memory_rooms
from moestream.errors import MemoryBudgetError, MoestreamError
from moestream.units import MiB

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmLck, VmRSS)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


# --- the trunk in memory the process owns; a shard shrunk under a running engine -------------------

SHRINK = """
    import os, sys
    import moestream
    from moestream.errors import CheckpointChangedError
    for ckpt, mode in zip(sys.argv[1::2], sys.argv[2::2]):  # one mode after the other, each its own copy
        print(mode, "begun", flush=True)
        shard = os.path.join(ckpt, "model.safetensors")
        engine = moestream.load(ckpt, cache="96KiB", io_mode=mode)  # 2 slots: experts are read every token
        maps = open("/proc/self/maps").read()
        print(mode, "mapped", sum(shard in line for line in maps.splitlines()), flush=True)
        stream = engine.stream("Hello there, how are you?", max_tokens=40, ignore_eos=True)
        next(stream); next(stream)
        os.truncate(shard, 4096)  # every expert and every trunk tensor is now past the end of the file
        try:
            for gen in stream:
                pass
            print(mode, "outcome finished", flush=True)
        except CheckpointChangedError as exc:
            print(mode, "outcome changed", str(exc).split(";")[0], flush=True)
        try:
            engine.generate("Hello", max_tokens=4)
            print(mode, "next finished", flush=True)
        except CheckpointChangedError as exc:
            print(mode, "next changed", str(exc).split(";")[0], flush=True)
        engine.close()
"""
MODES = ["direct", "pagecache", "mmap"]


@pytest.fixture(scope="module")
def shrunk(tiny_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, Path]]:
    """One child truncates a shard under a running engine in each io mode in turn (a copy each): the
    three cases share the torch and transformers imports of one process."""
    root = tmp_path_factory.mktemp("shrink")
    ckpts = {mode: shutil.copytree(tiny_dir("qwen3_moe"), root / mode / "ckpt") for mode in MODES}
    return _child(SHRINK, *(a for mode in MODES for a in (str(ckpts[mode]), mode))), ckpts


@pytest.mark.parametrize("mode", MODES)
def test_a_shard_truncated_under_a_running_engine_is_an_error_not_a_signal(shrunk, mode):
    """Before: with the trunk or the experts mapped from the shard, touching a page past the new end
    of the file killed the process with SIGBUS and no message (rc 135); the mmap io mode still did."""
    out, ckpts = shrunk
    ckpt = ckpts[mode]
    begun = [line.split()[0] for line in out.stdout.splitlines() if line.endswith(" begun")]
    # not -SIGBUS, not a traceback (the modes run in MODES' order: the one that died is the last begun)
    assert out.returncode == 0, (out.returncode, begun[-1:], out.stderr[-2000:])
    mine = [line.removeprefix(f"{mode} ") for line in out.stdout.splitlines() if line.startswith(f"{mode} ")]
    lines = dict(line.split(" ", 1) for line in mine if line != "begun")
    # the trunk was read, not mapped: only the mmap io mode maps the shard (for the experts)
    assert lines["mapped"] == ("0" if mode != "mmap" else "1")
    changed = f"checkpoint file {ckpt / 'model.safetensors'} changed since it was opened"
    # the request running when the file shrank either finished from memory or stopped naming the file
    assert lines["outcome"] == "finished" or lines["outcome"].startswith(f"changed {changed}")
    assert lines["next"].startswith(f"changed {changed} (its size changed from")


MMAP_READ = """
    import os, sys, threading
    from moestream.io.memory import AlignedBuffer
    from moestream.io.reader import Reader, Request
    shard = sys.argv[1]
    reader = Reader("mmap", threads=1)
    handle = reader.open(shard)
    os.truncate(shard, 8192)
    buffer, done, event = AlignedBuffer(65536), [], threading.Event()
    reader.submit([Request(priority=(0,), seq=reader.next_seq(), file=handle, offset=16384, length=65536,
                           needed=65536, dest=buffer.view, dest_address=buffer.address, piece=65536,
                           on_done=lambda err: (done.append(err), event.set()))])
    assert event.wait(30)
    reader.close()
    print(type(done[0]).__name__, done[0])
"""


def test_mmap_reader_checks_the_file_size_before_a_mapped_read(tiny_dir, tmp_path):
    """Before: the copy out of the mapping touched pages past the shrunk end: SIGBUS, rc 135."""
    shard = shutil.copy(tiny_dir("qwen3_moe") / "model.safetensors", tmp_path / "s.safetensors")
    out = _child(MMAP_READ, str(shard))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("CheckpointChangedError checkpoint file")
    assert "to 8192 bytes" in out.stdout


MMAP_RACE = """
    import os, sys, threading
    import moestream.io.reader as reader_module
    from moestream.io.memory import AlignedBuffer
    from moestream.io.reader import Reader, Request
    shard = sys.argv[1]
    if sys.argv[2] == "memmove":  # the copy as it was: a plain memmove out of the mapping
        import ctypes

        def plain(dest, source, n):
            ctypes.memmove(dest, source, n)
            return n

        reader_module.copy_mapped = plain
    reader = Reader("mmap", threads=1)
    handle = reader.open(shard)
    stale = os.fstat(handle.fd)

    class Os:  # the read's size check sees the file as it was: it shrinks right after the check
        def __getattr__(self, name):
            return getattr(os, name)

        def fstat(self, fd):
            reader_module.os = os
            os.truncate(shard, 8192)
            return stale

    reader_module.os = Os()
    buffer, done, event = AlignedBuffer(65536), [], threading.Event()
    reader.submit([Request(priority=(0,), seq=reader.next_seq(), file=handle, offset=16384, length=65536,
                           needed=65536, dest=buffer.view, dest_address=buffer.address, piece=65536,
                           on_done=lambda err: (done.append(err), event.set()))])
    assert event.wait(30)
    reader.close()
    print(type(done[0]).__name__, done[0])
"""


def test_a_mapped_read_survives_a_file_shrinking_after_its_size_check(tiny_dir, tmp_path):
    """The race the size check leaves: the file shrinks between the check and the copy. The copy goes
    through the kernel (process_vm_readv), which ends short instead of faulting: the same one-line
    error. With a plain memmove the process dies of SIGBUS (checked here too, so the case is real)."""
    src = tiny_dir("qwen3_moe") / "model.safetensors"
    shard = shutil.copy(src, tmp_path / "s.safetensors")
    out = _child(MMAP_RACE, str(shard), "copy_mapped")
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("CheckpointChangedError checkpoint file"), out.stdout
    assert "to 8192 bytes" in out.stdout
    shard = shutil.copy(src, tmp_path / "s.safetensors")
    assert _child(MMAP_RACE, str(shard), "memmove").returncode == -signal.SIGBUS


def test_the_trunk_is_locked_with_the_cache_and_unlocked_by_close(tiny_dir):
    before = _status("VmLck")
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", io_mode="pagecache") as engine:
        if not engine.cache.locked:
            pytest.skip("this process may not lock memory (RLIMIT_MEMLOCK without CAP_IPC_LOCK)")
        trunk = engine.loaded.trunk
        assert trunk.locked and trunk.nbytes > 200_000  # every non-expert tensor of the tiny model
        locked = _status("VmLck") - before
        assert locked >= engine.cache.allocated_bytes + trunk.nbytes
        assert f"trunk {trunk.nbytes / 1024:.1f} KiB (locked)" in engine.mode_line()
    assert _status("VmLck") == before and not trunk.locked
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", lock_memory=False) as engine:
        assert not engine.loaded.trunk.locked and "(unlocked)" in engine.mode_line()
        assert _status("VmLck") == before


# --- memory checked before it is taken ------------------------------------------------------------


@pytest.fixture(scope="module")
def synth96(tmp_path_factory) -> Path:
    return write_synth96(tmp_path_factory.mktemp("synth96") / "m")


CGROUP = """
    import sys
    from pathlib import Path
    import torch, transformers
    import moestream
    from moestream.engine.engine import Engine
    from moestream.errors import MemoryBudgetError, MoestreamError
    transformers.Qwen3MoeForCausalLM, transformers.AutoTokenizer  # imported before the limit is set
    ckpt, group = sys.argv[1], Path(sys.argv[2])
    # this process was started in the cgroup; now that torch and transformers are in, the limit is set
    # 128 MiB above the memory it cannot give back (the page cache of its libraries it can)
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    (group / "memory.limit_in_bytes").write_text(str(int(stat["total_rss"]) + (128 << 20)))
    try:
        moestream.load(ckpt, cache="96MiB")
        print("loaded 96MiB", flush=True)
    except MemoryBudgetError as exc:
        print("refused", exc, flush=True)
    with moestream.load(ckpt, cache="4MiB") as engine:
        print("generated", len(engine.generate("def f(x):", max_tokens=4, ignore_eos=True).tokens))
"""


def test_a_cache_larger_than_the_cgroup_limit_is_refused_with_the_numbers(synth96):
    """Before: in a 700 MiB cgroup, `generate --cache 960MiB` on a 960 MiB checkpoint was OOM-killed while
    mlock faulted the cache in: rc 137, no message. Here: a real cgroup v1 limit 128 MiB above what the
    child holds, and a 96 MiB cache (plus trunk, KV cache and working memory)."""
    root = v1_memory_root()
    if os.geteuid() != 0 or root is None:
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    group = root / f"moestream-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CGROUP), str(synth96), str(group)],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
    finally:
        group.rmdir()
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])  # -9 before: OOM-killed
    refused = next(line for line in out.stdout.splitlines() if line.startswith(("refused", "loaded")))
    assert refused.startswith("refused the expert cache (96.0 MiB) + the trunk (")
    assert "cgroup memory limit " in refused and f"at {group}, " in refused
    assert "use a cache of at most" in refused
    assert "generated 4" in out.stdout  # a cache that fits runs under the same limit


def test_memory_check_names_every_part_and_the_tightest_limit():
    need = MemoryNeed(
        [("the expert cache", 960 * MiB), ("the trunk", 40 * MiB), ("the KV cache at 4096 tokens", 8 * MiB)]
    )
    check_memory(need, [Room(2048 * MiB, "MemAvailable is 2.0 GiB")])  # fits: nothing raised
    check_memory(need, [])  # no limit could be read: nothing to refuse
    rooms = [Room(2048 * MiB, "MemAvailable is 2.0 GiB"), Room(650 * MiB, "cgroup memory limit 700.0 MiB")]
    with pytest.raises(MemoryBudgetError) as info:
        check_memory(need, rooms)
    assert str(info.value) == (
        "the expert cache (960.0 MiB) + the trunk (40.0 MiB) + the KV cache at 4096 tokens (8.0 MiB) need "
        "1008.0 MiB, but this process may use only 650.0 MiB more (cgroup memory limit 700.0 MiB); "
        "use a cache of at most 602.0 MiB"
    )
    with pytest.raises(MemoryBudgetError, match="nothing fits besides the cache"):
        check_memory(need, [Room(30 * MiB, "cgroup memory limit 100.0 MiB")])


def test_locking_past_rlimit_memlock_is_said_up_front_and_runs_unlocked():
    need = MemoryNeed([("the expert cache", 64 * MiB)], locked=64 * MiB)
    assert lock_allowed(need, None)  # unlimited, or CAP_IPC_LOCK
    assert lock_allowed(need, Room(128 * MiB, "RLIMIT_MEMLOCK (ulimit -l) is 128.0 MiB"))
    with pytest.warns(RuntimeWarning, match=r"locking 64.0 MiB .* RLIMIT_MEMLOCK \(ulimit -l\) is 8.0 MiB"):
        assert not lock_allowed(need, Room(8 * MiB, "RLIMIT_MEMLOCK (ulimit -l) is 8.0 MiB"))


def test_memory_rooms_read_meminfo_and_cgroup_files(tmp_path):
    """The limits as the kernel writes them (a cgroup v2 hierarchy, hybrid with v1 memory)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 2097152 kB\n")
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/jobs/a\n0::/user/b\n")
    (tmp_path / "proc/self/mountinfo").write_text(
        "30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    v1 = tmp_path / "sys/fs/cgroup/memory/jobs/a"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(700 * MiB))
    (v1 / "memory.usage_in_bytes").write_text(str(300 * MiB))
    (v1 / "memory.stat").write_text(
        f"cache 1\ntotal_inactive_file {50 * MiB}\ntotal_active_file {50 * MiB}\n"
    )
    (v1.parent / "memory.limit_in_bytes").write_text("9223372036854771712")  # no limit above it
    v2 = tmp_path / "sys/fs/cgroup/unified/user/b"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2.parent / "memory.max").write_text(f"{1024 * MiB}\n")
    (v2.parent / "memory.current").write_text(f"{100 * MiB}\n")
    (v2.parent / "memory.stat").write_text("anon 1\ninactive_file 0\nactive_file 0\n")
    rooms = {r.nbytes // MiB: r.why for r in memory_rooms(tmp_path)}
    assert rooms == {
        500: f"cgroup memory limit 700.0 MiB at {v1}, 200.0 MiB of it in use",
        924: f"cgroup memory limit 1.0 GiB at {v2.parent}, 100.0 MiB of it in use",
        2048: "MemAvailable is 2.0 GiB",
    }


def test_close_unlocks_and_frees_the_cache_at_once(synth96):
    engine = moestream.load(str(synth96), cache="64MiB", io_mode="pagecache")
    if not engine.cache.locked:
        engine.close()
        pytest.skip("this process may not lock memory (RLIMIT_MEMLOCK without CAP_IPC_LOCK)")
    engine.generate("def f(x):", max_tokens=2, ignore_eos=True)
    locked, rss = _status("VmLck"), _status("VmRSS")
    engine.close()  # the engine object is still referenced: nothing is left to the garbage collector
    assert locked - _status("VmLck") >= 64 * MiB - 1024 * 1024
    assert rss - _status("VmRSS") >= 60 * MiB  # the slots' pages are gone, not only unlocked
    with pytest.raises(MoestreamError, match="the engine is closed"):
        engine.generate("def f(x):", max_tokens=2)
    engine.close()  # twice is fine


@pytest.mark.parametrize("trunk_dtype", [None, "float32"], ids=["blocks kept", "dequantized"])
def test_the_planned_trunk_is_the_trunk_held(tmp_path, tiny_dir, trunk_dtype):
    """The memory check sizes the trunk before it is read: what it planned must be what the loaded
    model holds (a GGUF trunk kept in Q8_0 blocks, or dequantized by --trunk-dtype; a safetensors one)."""
    from gguf import GGMLQuantizationType as Q
    from tiny_gguf import write_gguf

    from moestream.engine.memory_plan import memory_need

    gguf_path = write_gguf(tiny_dir("qwen3_moe"), tmp_path / "model.gguf", ftype=Q.Q8_0)
    for path in (gguf_path, tiny_dir("qwen3_moe")):
        with moestream.load(str(path), cache="4MiB", trunk_dtype=trunk_dtype) as engine:
            planned = dict(memory_need(engine.loaded.description, engine.options).parts)["the trunk"]
            held = engine.loaded.trunk.nbytes
        assert abs(planned - held) <= 0.02 * held, (path, planned, held)


def test_the_kv_cache_on_ggmls_cuda_backend_takes_no_host_memory(tiny_dir, monkeypatch):
    """On ggml's CUDA backend (--device cuda resolved to it: `ggml_device`) the graphs' KV cache lives on
    the GPU alone: the memory check and the auto budgets count none of it in host memory (they did,
    leaving a host cache 384 MiB smaller under a 2.75 GiB limit on the H100, 12-layer file, 8192
    positions), and the runner's host tensors that name the device's copies are never written; nor the
    graphs' scratch, where the GPU computes a tier's misses. On ggml's CPU backend (the tests' stand-in)
    the device's copy is host memory: counted once, where it was."""
    import dataclasses

    import torch

    from moestream.engine.auto_budget import _runner_parts
    from moestream.engine.memory_plan import memory_need

    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="4MiB", trunk="ggml", ctx_size=256) as engine:
        description, options = engine.loaded.description, engine.options
        runner = engine.runner
        host = [t for pair in runner.kv for t in pair if t.numel()]
        before = [t.view(torch.uint8).clone() for t in host]  # (unwritten: any bits, NaNs among them)
        engine.generate([5, 17, 33, 2], max_tokens=4, ignore_eos=True)
        assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(host, before))  # the device took them
    kv_name = "the KV cache at 256 tokens"
    assert dict(memory_need(description, options).parts)[kv_name] > 0
    on_gpu = dataclasses.replace(options, ggml_device="cuda")
    assert dict(memory_need(description, on_gpu).parts)[kv_name] == 0
    kv = (kv_name, description.kv_bytes)
    assert _runner_parts(description, kv, options)[0][1] > 0
    assert _runner_parts(description, kv, on_gpu)[0][1] == 0
    # the graphs' scratch: the GPU's where its tier's misses are uploaded (the default), the CPU's where
    # its graphs compute them from the host cache (counted at the runner's plan)
    graphs = "the ggml graphs' buffers"
    assert dict(_runner_parts(description, kv, options))[graphs] > 0
    assert dict(_runner_parts(description, kv, on_gpu))[graphs] == 0
    for way, held in (("upload", 0), ("host", 1), ("split", 1), ("auto", 1)):
        monkeypatch.setenv("MOESTREAM_TIER_MISSES", way)
        assert (dict(_runner_parts(description, kv, on_gpu))[graphs] > 0) == held, way


def test_the_trunk_on_ggmls_cuda_backend_takes_no_host_memory_but_the_routers(tiny_dir, monkeypatch):
    """On ggml's CUDA backend (`ggml_device`) the trunk is copied to the GPU at load and its host copy
    given back before the cache is taken, but the routers' (engine/trunk_release.py): the memory check
    counts only the routers beside the cache, and the load's own need (the whole trunk, before the cache)
    apart; the auto budgets, measured after the trunk went, no longer keep the routers' float32 copies.
    On ggml's CPU backend (the tests' stand-in) the device's copy is host memory: counted whole."""
    import dataclasses

    from moestream.engine.auto_budget import _runner_parts
    from moestream.engine.memory import WORKING_BYTES
    from moestream.engine.memory_plan import CACHE, load_need, memory_need, plan_memory

    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="4MiB", trunk="ggml", ctx_size=256) as engine:
        description, options = engine.loaded.description, engine.options
        on = engine.loaded.trunk_device
    on_gpu = dataclasses.replace(options, ggml_device="cuda")
    need = dict(memory_need(description, options).parts)
    trunk = need["the trunk"]
    routers = dict(memory_need(description, on_gpu).parts)["the trunk"]
    assert routers == on.kept == 2 * 8 * 64 * 4  # two MoE layers' routers of 8 experts, float32
    assert trunk > 50 * routers
    assert load_need(description, options) is None
    loading = load_need(description, on_gpu)
    assert loading is not None and loading.total == trunk + WORKING_BYTES
    # a room the cache and the routers fit, not the cache and the whole trunk; the trunk alone fits it
    room = need[CACHE] + routers + WORKING_BYTES
    monkeypatch.setattr("moestream.engine.memory_plan.memory_rooms", lambda: [Room(room, "a test limit")])
    with pytest.raises(MemoryBudgetError, match="the trunk"):
        plan_memory(description, options)
    plan_memory(description, on_gpu)  # fits
    tight = [Room(trunk + WORKING_BYTES - 1, "a test limit")]
    monkeypatch.setattr("moestream.engine.memory_plan.memory_rooms", lambda: tight)
    with pytest.raises(MemoryBudgetError, match="the trunk, read before it is copied to the GPU"):
        plan_memory(description, dataclasses.replace(on_gpu, cache=1))
    spec = dataclasses.replace(description.spec, copied_bytes=12345)  # routers kept in 16 bits
    copied = dataclasses.replace(description, spec=spec)
    kv = ("the KV cache", description.kv_bytes)
    assert dict(_runner_parts(copied, kv, options))["the routers in float32"] == 12345
    assert "the routers in float32" not in dict(_runner_parts(copied, kv, on_gpu))
