"""The process's memory around the trunk's upload and release on a ggml backend (engine/trunk_release.py):
/proc/self/smaps_rollup's Rss, Anonymous and Locked before every tensor of the graphs' spec is copied to
the device, after the copy, after the host pages are given back, and after a prefill and a few decoded
tokens (graph sets built after the release).

    python benchmarks/trunk_release_rss.py MODEL.gguf [--backend cpu] [--cache 2GiB]

On ggml's CPU backend (`--backend cpu`, the default: no GPU needed) the device's copy is host memory too,
so the copy adds the trunk and the release takes it back; on ggml's CUDA backend (`--backend cuda`) the
copy is in VRAM and the release alone shows in RAM. The cache must hold every expert (the device's step is
one graph over all of them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moestream
from moestream.ggml.backend import DeviceMemory


def rollup() -> dict[str, int]:
    """Rss, Anonymous and Locked bytes of the process (/proc/self/smaps_rollup)."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Anonymous", "Locked"):
            out[name] = int(rest.split()[0]) * 1024
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cache", default="2GiB")
    args = parser.parse_args()
    os.environ["MOESTREAM_GGML_BACKEND"] = args.backend
    marks: list[tuple[str, dict[str, int]]] = []
    upload, release = DeviceMemory.upload_weights, DeviceMemory.release_host

    def measured_upload(self, tensors):
        marks.append(("before the copy", rollup()))
        placed = upload(self, tensors)
        marks.append(("after the copy", rollup()))
        return placed

    def measured_release(self, ranges, holders):  # called once the pages are dropped
        release(self, ranges, holders)
        marks.append(("after the release", rollup()))

    DeviceMemory.upload_weights, DeviceMemory.release_host = measured_upload, measured_release
    with moestream.load(args.model, cache=args.cache, threads=1, ctx_size=512) as engine:
        engine.generate(list(range(3, 300)), max_tokens=4, ignore_eos=True)
        marks.append(("after 297 + 4 tokens", rollup()))
        on = engine.loaded.trunk_device
        print(f"trunk {engine.loaded.trunk.nbytes} B; {on}")
    before = None
    for name, m in marks:
        mib = {k: v / 2**20 for k, v in m.items()}
        line = f"{name:22s} Rss {mib['Rss']:8.1f} MiB  Anonymous {mib['Anonymous']:8.1f}"
        line += f"  Locked {mib['Locked']:7.1f}"
        if before is not None:
            line += f"  (Rss {(m['Rss'] - before['Rss']) / 2**20:+.1f} MiB)"
        print(line)
        before = m


if __name__ == "__main__":
    main()
