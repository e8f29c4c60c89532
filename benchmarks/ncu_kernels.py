"""Nsight Compute's per-launch CSV (`ncu --metrics gpu__time_duration.sum --csv --print-units base`) summed
per kernel: launches and time, for one or more runs side by side (benchmarks/ggml_cuda_profile.sh makes
two: llama.cpp's and moestream's decoded tokens). Lines that are not the CSV (the program's own output,
ncu's ==PROF== notes) are skipped.

    python3 benchmarks/ncu_kernels.py ncu-llama.csv ncu-moestream.csv [--top 40]
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

_MICROSECONDS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def short(name: str) -> str:
    """A kernel's name without its argument list, its templates' arguments shortened to 60 characters."""
    name, depth = name.strip(), 0
    for i, c in enumerate(name):  # the argument list: the first "(" outside the templates' brackets
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == "(" and depth == 0:
            name = name[:i]
            break
    if "<" in name:
        base, rest = name.split("<", 1)
        return base + "<" + rest[:60] + ("..." if len(rest) > 60 else "")
    return name


def read(path: str) -> dict[str, list[float]]:
    """Kernel name -> the durations of its launches, in microseconds."""
    rows: dict[str, list[float]] = defaultdict(list)
    header = None
    with open(path, errors="replace") as f:
        for line in f:
            if not line.startswith('"'):
                continue
            cells = next(csv.reader([line]))
            if header is None:
                if "Kernel Name" in cells and "Metric Value" in cells:
                    header = {c: i for i, c in enumerate(cells)}
                continue
            if len(cells) < len(header) or cells[header["Metric Name"]] != "gpu__time_duration.sum":
                continue
            unit = cells[header["Metric Unit"]]
            value = float(cells[header["Metric Value"]].replace(",", ""))
            scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(
                unit, 1e-3
            )
            rows[short(cells[header["Kernel Name"]])].append(value * scale)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    for path in args.csv:
        rows = read(path)
        total = sum(sum(v) for v in rows.values())
        launches = sum(len(v) for v in rows.values())
        print(f"== {path}: {launches} launches, {total / 1e3:.3f} ms of kernels")
        print(f"{'launches':>9} {'total us':>10} {'mean us':>8}  kernel")
        for name, v in sorted(rows.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
            print(f"{len(v):>9} {sum(v):>10.1f} {sum(v) / len(v):>8.2f}  {name}")


if __name__ == "__main__":
    main()
