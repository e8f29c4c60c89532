"""What the guarded copy out of a file mapping costs (`--io-mode mmap`): `copy_mapped` (process_vm_readv
on the process itself, an error instead of SIGBUS where the file shrank) against the plain memmove it
replaced, 128 KiB pieces out of a page-cached file, so that the copy alone is measured (no disk).

    .venv/bin/python benchmarks/mapped_copy.py [--mib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

import numpy as np

from moestream.io.memory import AlignedBuffer, copy_mapped, memmove


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--piece-kib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size, piece = args.mib << 20, args.piece_kib << 10
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        f.write(os.urandom(size))
        f.flush()
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        source = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        dest = AlignedBuffer(piece)
        # a first pass maps every page, so that the rounds measure copies, not page faults
        for offset in range(0, size, piece):
            memmove(dest.address, source + offset, piece)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, copy in (("memmove", memmove), ("copy_mapped", copy_mapped)):
                start = time.perf_counter()
                for offset in range(0, size, piece):
                    copy(dest.address, source + offset, piece)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
        assert bytes(dest.view[:piece]) == mapping[size - piece :]
        pieces = size // piece
        for name, seconds in best.items():
            print(
                f"{name:12s} {args.mib / seconds:8.0f} MiB/s, {seconds / pieces * 1e6:6.1f} us per "
                f"{args.piece_kib} KiB piece (best of {args.rounds})"
            )
        del source
        dest.free()


if __name__ == "__main__":
    main()
