"""Which node of a device step's graph differs between ggml's CUDA graphs (captured, replayed) and direct
launches: the open question of issue 31 (2026-12-04: a replayed step's first flash attention differs from
the direct one on the suite's tiny models while every input it reads is equal at the end of the step).

    # each run: a tiny model (head dim 64) on ggml's CUDA backend, prefill + 4 decode steps, scratch never
    # reused (every node's output stays readable); the step graph's scratch and the device regions saved
    MOESTREAM_CUDA_GRAPHS=1 python benchmarks/cuda_graph_bisect.py dump graphs.npz [--arch mixtral]
    GGML_CUDA_DISABLE_GRAPHS=1 python benchmarks/cuda_graph_bisect.py dump direct.npz
    python benchmarks/cuda_graph_bisect.py compare graphs.npz direct.npz   # the first nodes that differ

`--backend cpu` runs the same on ggml's CPU backend (to check the tool here).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ["MOESTREAM_GGML_SCRATCH_REUSE"] = "0"  # read when moestream.ggml.net is imported

import numpy as np  # noqa: E402

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
FORCED = [9, 150, 77, 31]


def _bytes(lib, buffer_handle: int, base: int, nbytes: int, tensor: int = 0) -> np.ndarray:
    from moestream.ggml.lib import InitParams

    out = np.zeros(nbytes, dtype=np.uint8)
    ctx = 0
    if not tensor:  # a scratch buffer: an I8 tensor over it to read it through
        ctx = lib.base.ggml_init(InitParams(4 * lib.base.ggml_tensor_overhead(), None, True))
        tensor = lib.base.ggml_new_tensor_1d(ctx, 24, nbytes)
        lib.base.ggml_backend_tensor_alloc(buffer_handle, tensor, base)
    lib.base.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, nbytes)
    if ctx:
        lib.base.ggml_free(ctx)
    return out


def dump(args: argparse.Namespace) -> None:
    from tiny_models import write_tiny

    import moestream
    from moestream.ggml.lib import GgmlTensor

    os.environ["MOESTREAM_GGML_BACKEND"] = args.backend
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny(args.arch, Path(tmp) / args.arch, head_dim=64)
        with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
            runner = engine.runner
            logits, kv = runner(PROMPT, None)
            argmax = []
            for token in FORCED:
                logits, kv = runner([token], kv)
                argmax.append(int(logits.argmax()))
            gs = runner._sets[(1, 256, (0,))]
            net, buf, lib = gs.whole[1], gs.arena.buffer, runner.memory.lib
            saved = {"scratch": _bytes(lib, buf.handle, buf.base, buf.size), "argmax": np.array(argmax)}
            names, offsets, sizes = [], [], []
            b = lib.base
            for i in range(b.ggml_graph_n_nodes(net.gf)):
                ptr = b.ggml_graph_node(net.gf, i)
                t = GgmlTensor.from_address(ptr)
                if t.buffer == buf.handle and not t.view_src:
                    names.append(f"{i}:{b.ggml_op_name(t.op).decode()}")
                    offsets.append(t.data - buf.base)
                    sizes.append(b.ggml_nbytes(ptr))
            for region in runner.memory.regions.values():
                if region.role != "weight" and region.name:
                    saved["r_" + region.name] = _bytes(lib, 0, 0, region.nbytes, region.tensor)
            saved.update(names=np.array(names), offsets=np.array(offsets), sizes=np.array(sizes))
            np.savez(args.out, **saved)
    print(args.arch, "greedy after each forced token:", argmax, "| nodes in scratch:", len(names))


def compare(args: argparse.Namespace) -> None:
    a, b = np.load(args.a), np.load(args.b)
    print("greedy:", a["argmax"].tolist(), b["argmax"].tolist())
    shown = 0
    for name, offset, size in zip(a["names"], a["offsets"], a["sizes"]):
        x, y = a["scratch"][offset : offset + size], b["scratch"][offset : offset + size]
        if not np.array_equal(x, y) and shown < 12:
            diff = np.abs(x.view(np.float32) - y.view(np.float32)).max() if size % 4 == 0 else float("nan")
            print(f"differs: node {name}, {size} bytes at {offset}, max |diff| {diff:.4g}")
            shown += 1
    for key in a.files:
        if key.startswith("r_"):
            unequal = np.nonzero(a[key] != b[key])[0]
            state = "equal" if not len(unequal) else f"{len(unequal)} bytes differ, the first at {unequal[0]}"
            print(f"region {key[2:]}: {state}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--arch", default="mixtral")
    d.add_argument("--backend", default="cuda")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    dump(args) if args.cmd == "dump" else compare(args)


if __name__ == "__main__":
    main()
