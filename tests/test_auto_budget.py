"""`auto` budgets, the default: the expert cache sized from the machine's memory at load.

Under a real cgroup v1 limit, in a child process: a limit too small for the smallest cache is refused in
one line (API and CLI), a mid limit gives a cache between the smallest and every expert, equal to the
room less the parts (each part checked against its own measurement), a large one caches every expert;
an explicit size wins. The CUDA split and the choice itself as pure functions with given numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from memory_limits import v1_memory_root, write_synth96

from moestream.cli import main
from moestream.engine.auto_budget import MARGIN_SHARE, cuda_split, largest_fit
from moestream.engine.memory import Room
from moestream.engine.options import AUTO, EngineOptions
from moestream.engine.runners import EagerRunner
from moestream.errors import MemoryBudgetError
from moestream.units import MiB

ROOT = Path(__file__).resolve().parents[1]
SLOT = 3 * (256 * 1024 + 4096)  # one expert of synth96: gate, up, down of 256 KiB, each a page apart
EXPERTS = 2 * 64


@pytest.fixture(scope="module")
def synth96(tmp_path_factory) -> Path:
    return write_synth96(tmp_path_factory.mktemp("auto96") / "m")


# The child is started in its own cgroup. A first load with no limit learns what the room must keep
# besides the cache (the parts of `engine.loaded.auto`); then the limit is set to what the child cannot
# give back plus those parts plus `share` x every expert (0: too small for the smallest cache), and it
# loads again.
CHILD = """
    import contextlib, io, json, re, sys
    from pathlib import Path
    import moestream
    from moestream.cli import main
    from moestream.errors import MemoryBudgetError

    def status(field):
        return int(re.search(rf"{field}:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024

    def unreclaimable(group):
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        usage = int((group / "memory.usage_in_bytes").read_text())
        return usage - int(stat["total_inactive_file"]) - int(stat["total_active_file"])

    def held(buf):  # the buffers' tensors, as a backend mirrors them
        return sum(t.nbytes for _, t in buf.tensors())

    ckpt, group, share = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    with moestream.load(ckpt) as probe:  # no limit yet: every expert fits, the parts are what counts
        parts = sum(n for name, n in probe.loaded.auto[0].kept if not name.startswith("a margin"))
        every = probe.loaded.auto[0].every
    room = (parts + share * every) * 32 / 31 if share else parts / 2
    limit = unreclaimable(group) + int(room) + (8 << 20)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    out = {"limit": limit, "mapped_before": status("RssFile")}
    try:
        engine = moestream.load(ckpt)
    except MemoryBudgetError as exc:
        out["refused"] = str(exc)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            out["cli_rc"] = main(["generate", ckpt, "-p", "hi", "-n", "2"])
        out["cli_stderr"] = err.getvalue()
        print(json.dumps(out))
        sys.exit(0)
    budget = engine.loaded.auto[0]
    out.update(
        chosen=engine.options.cache, room=budget.room.nbytes, why=budget.room.why, kept=dict(budget.kept),
        every=budget.every, allocated=engine.cache.allocated_bytes, capacity=engine.cache.capacity,
        runner_kv=engine.runner.kv_bytes, mode=engine.mode_line(),
        room_after=limit - unreclaimable(group), mapped_after=status("RssFile"),
    )
    # a prompt that walks the context through several prefill chunks and spans, under the same limit
    gen = engine.generate(list(range(1, 1001)), max_tokens=16, ignore_eos=True)
    out["graphs_used"] = sum(s.arena.nbytes + held(s.buf) for s in engine.runner._sets.values())
    out["generated"] = len(gen.tokens)
    engine.close()
    with moestream.load(ckpt, cache="4MiB") as explicit:  # an explicit size wins
        out["explicit"] = [explicit.options.cache, len(explicit.loaded.auto), explicit.mode_line()]
    print(json.dumps(out))
"""


def _run_limited(ckpt: Path, share: float) -> dict:
    root = v1_memory_root()
    if os.geteuid() != 0 or root is None:
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    group = root / f"moestream-auto-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CHILD), str(ckpt), str(group), str(share)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MOESTREAM_THREADS": "1"},
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
    finally:
        group.rmdir()
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])  # -9: OOM-killed
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_parts(out: dict) -> None:
    """Each part the room kept, against its own measurement, and the room against the cgroup's files."""
    kept = out["kept"]
    assert kept["the F16 KV cache at 4096 tokens"] == out["runner_kv"]  # the runner's tensors, allocated
    assert 0 < out["graphs_used"] <= kept["the ggml graphs' buffers"]  # what a 1000-token prompt built
    assert out["mapped_before"] <= kept["the libraries' mapped files"] <= out["mapped_after"]
    assert kept["working memory"] == 64 * MiB
    assert kept[f"a margin of 1/{MARGIN_SHARE}"] == out["room"] // MARGIN_SHARE
    # the room when the cache was sized = the room after load + the cache allocated since (+ a little,
    # or - a little: the child can give back pages between the two readings; 73 KiB seen on 4 workers)
    assert -2 * MiB <= out["room"] - (out["room_after"] + out["allocated"]) <= 32 * MiB
    assert out["why"].startswith("cgroup memory limit ") and "moestream-auto-" in out["why"]
    assert out["every"] == EXPERTS * SLOT
    assert out["allocated"] <= out["chosen"]
    assert out["explicit"][:2] == [4 * MiB, 0] and "auto cache" not in out["explicit"][2]


def test_a_limit_too_small_for_the_smallest_cache_is_refused_in_one_line(synth96):
    out = _run_limited(synth96, 0)
    assert out["refused"].startswith("the cache at its smallest (1.5 MiB) + the F16 KV cache at 4096 tokens")
    assert "cgroup memory limit " in out["refused"] and "moestream-auto-" in out["refused"]
    assert out["cli_rc"] == 2
    line = out["cli_stderr"].strip()
    assert "\n" not in line and line.startswith("moestream: error: the cache at its smallest (1.5 MiB)")
    assert "free memory or raise the limit" in line


def test_a_mid_limit_gives_the_largest_cache_that_fits(synth96):
    out = _run_limited(synth96, 0.5)
    _check_parts(out)
    # the independent computation: the room less every part, in whole slots (one size class here)
    expected = out["room"] - sum(out["kept"].values())
    assert 2 * SLOT <= expected < EXPERTS * SLOT
    assert out["chosen"] == expected
    assert out["capacity"] == expected // SLOT and 2 < out["capacity"] < EXPERTS
    assert "auto cache: the largest that fits (tightest limit: cgroup memory limit " in out["mode"]
    assert "less the F16 KV cache at 4096 tokens 4.0 MiB + the ggml graphs' buffers " in out["mode"]
    assert out["generated"] == 16  # ran under the limit, not OOM-killed


def test_a_large_limit_caches_every_expert(synth96):
    out = _run_limited(synth96, 1.5)
    _check_parts(out)
    assert out["room"] - sum(out["kept"].values()) > EXPERTS * SLOT
    assert out["chosen"] == out["allocated"] == EXPERTS * SLOT and out["capacity"] == EXPERTS
    assert f"cache 97.5 MiB = {EXPERTS} slots" in out["mode"]
    assert (
        "auto cache: every expert, nothing streamed (97.5 MiB; tightest limit: cgroup memory" in out["mode"]
    )
    assert out["generated"] == 16


def test_auto_is_the_default_and_accepted_explicitly(tiny_dir, capsys):
    assert EngineOptions().cache == AUTO and EngineOptions().host_cache == AUTO
    assert EngineOptions(cache="2GiB").host_cache == 0  # an explicit cache keeps the CUDA host tier off
    assert EngineOptions(cache=" Auto ").cache == AUTO
    with pytest.raises(ValueError, match="sized at load"):
        EngineOptions().stream_config()
    path = str(tiny_dir("qwen3_moe"))
    assert main(["generate", path, "--cache", "auto", "-p", "Hello", "-n", "2", "--ignore-eos"]) == 0
    assert "| auto cache: every expert, nothing streamed (" in capsys.readouterr().err
    assert main(["generate", path, "--cache", "108KiB", "-p", "Hello", "-n", "2", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "cache 108.0 KiB = 3 slots" in err and "auto cache" not in err


def test_the_eager_trunk_keeps_a_full_context_prefill(tiny_dir):
    """Under transformers (no ggml graphs) a prompt is prefilled whole: its activations are kept."""
    import moestream

    with moestream.load(str(tiny_dir("qwen3_moe")), trunk="eager", ctx_size=256) as engine:
        kept = dict(engine.loaded.auto[0].kept)
        cfg = engine.config
        hidden, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        assert kept["activations"] == 4 * 256 * (16 * hidden + 3 * k * inter)
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        element = engine.dtype.itemsize
        assert kept["the KV cache at 256 tokens"] == cfg.num_hidden_layers * 256 * 2 * heads * dim * element
        assert "the ggml graphs' buffers" not in kept and isinstance(engine.runner, EagerRunner)


# --- the choice as pure functions ----------------------------------------------------------------


def test_largest_fit_keeps_the_parts_and_the_margin():
    room = Room(1024 * MiB, "MemAvailable is 1.0 GiB")
    kept = [("the KV cache", 100 * MiB), ("working memory", 64 * MiB)]
    mid = largest_fit("cache", room, kept, every=2048 * MiB, minimum=10 * MiB)
    assert mid.nbytes == 1024 * MiB - 164 * MiB - 32 * MiB and not mid.holds_all
    assert (
        "auto cache: the largest that fits (tightest limit: MemAvailable is 1.0 GiB; 1.0 GiB left, less "
        in (mid.describe())
    )
    every = largest_fit("cache", room, kept, every=500 * MiB, minimum=10 * MiB)
    assert every.nbytes == 500 * MiB and every.holds_all
    # an allocation that rounds up (a size class's top-k floor) is brought back under what is free
    rounded = largest_fit("cache", room, kept, 2048 * MiB, 10 * MiB, allocated=lambda b: b + 3 * MiB)
    assert rounded.nbytes + 3 * MiB == mid.nbytes
    with pytest.raises(MemoryBudgetError, match=r"less than the smallest cache this model runs with \(900"):
        largest_fit("cache", room, kept, every=2048 * MiB, minimum=900 * MiB)


def test_cuda_split_gpu_from_free_vram_host_from_ram():
    gpu_room = Room(80 * 1024 * MiB, "80.0 GiB of the GPU's 139.8 GiB free")
    host_room = Room(64 * 1024 * MiB, "MemAvailable is 64.0 GiB")
    gpu_kept = [("the KV cache", 2048 * MiB), ("activations", 1024 * MiB), ("CUDA workspaces", 512 * MiB)]
    host_kept = [("working memory", 64 * MiB)]
    experts = 100 * 1024 * MiB
    gpu, host = cuda_split(gpu_room, gpu_kept, experts, 72 * MiB, host_room, host_kept, experts, 72 * MiB)
    # GPU: 80 GiB free - 3.5 GiB kept - 80 GiB / 32; host: 64 GiB - 64 MiB - 64 GiB / 32
    assert gpu.nbytes == 80 * 1024 * MiB - 3584 * MiB - 2560 * MiB
    assert host.nbytes == 64 * 1024 * MiB - 64 * MiB - 2048 * MiB
    # every expert fits the GPU: the host tier is staging only
    gpu, host = cuda_split(
        gpu_room, gpu_kept, 8192 * MiB, 72 * MiB, host_room, host_kept, 8192 * MiB, 72 * MiB
    )
    assert gpu.nbytes == 8192 * MiB and gpu.holds_all and host.nbytes == 0
    assert host.describe().startswith("auto host tier: none, staging slots only")
    # an explicit GPU tier wins; the host tier still comes from RAM, capped at every expert
    gpu, host = cuda_split(
        gpu_room,
        gpu_kept,
        experts,
        72 * MiB,
        host_room,
        host_kept,
        4096 * MiB,
        72 * MiB,
        gpu_given=1024 * MiB,
    )
    assert gpu.nbytes == 1024 * MiB and host.nbytes == 4096 * MiB
    # RAM with no room past the staging slots: staging only; a GPU with no room for top-k slots: refused
    tight = Room(100 * MiB, "MemAvailable is 100.0 MiB")
    assert (
        cuda_split(gpu_room, gpu_kept, experts, 72 * MiB, tight, host_kept, experts, 72 * MiB)[1].nbytes == 0
    )
    with pytest.raises(MemoryBudgetError, match="the GPU tier at its smallest"):
        cuda_split(Room(3 * 1024 * MiB, "3.0 GiB of the GPU's 8.0 GiB free"), gpu_kept, experts, 72 * MiB,
                   host_room, host_kept, experts, 72 * MiB)  # fmt: skip
