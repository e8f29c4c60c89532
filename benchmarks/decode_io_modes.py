"""Decode with each io mode side by side in one run, with the O_DIRECT ceiling measured in the same run.

For every (readahead, io mode): drop the page cache, run `moestream generate --json` in a child process
(inside a cgroup v1/v2 memory limit when --memory-limit is given), and report decode tok/s, MiB/token,
hit rate and the effective read bandwidth while decoding. Also: compute-only time per token with every
expert cached (a warm run over the same prompt). Needs root for dropping caches, readahead and cgroups.

    python benchmarks/decode_io_modes.py CHECKPOINT --cache 1GiB --tokens 32 \
        [--modes direct,pagecache,mmap] [--readahead-kb 8192,128] [--memory-limit 3GiB] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from io_ceiling import expert_ranges, measure

from moestream.bench.system import MemoryCgroup, device_for_path, drop_caches, make_memory_cgroup
from moestream.units import GiB, MiB, parse_size

PROMPT = "The history of the printing press shows how a new machine can change the way people"
RESIDENT_PROBE = """
import json, sys, time, moestream
engine = moestream.load(sys.argv[1], cache=sys.argv[2], io_mode="pagecache")
engine.generate(sys.argv[3], max_tokens=int(sys.argv[4]), ignore_eos=True)  # fills the cache
out = engine.generate(sys.argv[3], max_tokens=int(sys.argv[4]), ignore_eos=True)
print(json.dumps({"stats": out.stats.to_dict(), "tokens": out.tokens}))
"""


def run_child(argv: list[str], cgroup: MemoryCgroup | None) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, preexec_fn=cgroup.enter if cgroup else None)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    return result


def generate(ckpt: str, mode: str, args: argparse.Namespace, cgroup: MemoryCgroup | None) -> dict:
    drop_caches()
    argv = [
        sys.executable,
        "-m",
        "moestream",
        "generate",
        ckpt,
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(args.tokens),
        "--ignore-eos",
        "--cache",
        args.cache,
        "--io-mode",
        mode,
        "--io-threads",
        str(args.io_threads),
        "--json",
    ]
    return run_child(argv, cgroup)


def row(label: str, res: dict) -> dict:
    s = res["stats"]
    d = s["decode"]
    return {
        "run": label,
        "decode_tok_s": s["decode_tok_s"],
        "prefill_tok_s": s["prefill_tok_s"],
        "mib_per_token": d["bytes_read"] / MiB / max(1, d["tokens"]),
        "hit_rate": s["hit_rate"],
        "decode_read_gib_s": d["bytes_read"] / GiB / d["seconds"] if d["seconds"] else 0.0,
        "ms_per_token": 1000 * d["seconds"] / max(1, d["tokens"]),
        "read_wait_ms_per_token": 1000 * d["read_wait_s"] / max(1, d["tokens"]),
        "bytes_read": s["bytes_read"],
        "tokens": res["tokens"],
    }


def median_row(rs: list[dict]) -> dict:
    """The run whose decode speed is the median of its repeats (the rows keep their own figures)."""
    ordered = sorted(rs, key=lambda r: r["decode_tok_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["repeats_decode_tok_s"] = [round(r["decode_tok_s"], 3) for r in rs]
    return chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--cache", default="1GiB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--modes", default="direct,pagecache,mmap")
    p.add_argument("--readahead-kb", default="8192,128")
    p.add_argument("--memory-limit", default=None)
    p.add_argument("--ceiling-seconds", type=float, default=8.0)
    p.add_argument("--skip-resident", action="store_true")
    p.add_argument(
        "--rounds", type=int, default=2, help="repeat every run this often, interleaved; report medians"
    )
    p.add_argument("--json", default=None, help="write all results here")
    args = p.parse_args()
    device = device_for_path(args.checkpoint)
    if device is None:
        raise SystemExit(f"{args.checkpoint} is not on a block device")
    original_ra = device.readahead_kb()
    cgroup = make_memory_cgroup(parse_size(args.memory_limit)) if args.memory_limit else None
    ranges = expert_ranges(args.checkpoint)
    results = {
        "device": device.describe(),
        "readahead_default_kb": original_ra,
        "memory_limit": args.memory_limit,
        "cache": args.cache,
        "tokens": args.tokens,
        "runs": [],
    }
    drop_caches()
    results["ceiling_before"] = measure(ranges, 128 * 1024, args.io_threads, args.ceiling_seconds)
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(args.rounds):
            for ra in [int(x) for x in args.readahead_kb.split(",")]:
                device.set_readahead_kb(ra)
                for mode in args.modes.split(","):
                    if mode == "direct" and ra != int(args.readahead_kb.split(",")[0]):
                        continue  # O_DIRECT bypasses readahead: one run per round is enough
                    before = device.bytes_read()
                    r = row(f"{mode} (readahead {ra} KiB)", generate(args.checkpoint, mode, args, cgroup))
                    r["device_bytes_read"] = device.bytes_read() - before
                    runs.setdefault(r["run"], []).append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    finally:
        device.set_readahead_kb(original_ra)
    results["all_runs"] = runs
    results["runs"] = [median_row(rs) for rs in runs.values()]
    drop_caches()
    results["ceiling_after"] = measure(ranges, 128 * 1024, args.io_threads, args.ceiling_seconds)
    if not args.skip_resident:
        all_bytes = sum(length for _, _, length in ranges) + len(ranges) * 8192
        res = run_child(
            [sys.executable, "-c", RESIDENT_PROBE, args.checkpoint, str(all_bytes), PROMPT, str(args.tokens)],
            None,
        )
        results["resident"] = row("every expert cached (compute only)", res)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(results: dict) -> None:
    c0, c1 = results["ceiling_before"]["gib_s"], results["ceiling_after"]["gib_s"]
    ceiling = (c0 + c1) / 2
    print(
        f"\nO_DIRECT ceiling: {c0:.3f} GiB/s before, {c1:.3f} GiB/s after (mean {ceiling:.3f}); device "
        f"{results['device']}, cache {results['cache']}, memory limit {results['memory_limit']}"
    )
    print(
        "| run | decode tok/s (repeats) | prefill tok/s | MiB/token | hit rate | read GiB/s while decoding | "
        "% of ceiling | ms/token | read wait ms/token | device GiB read (whole run) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs = results["runs"] + ([results["resident"]] if "resident" in results else [])
    for r in runs:
        print(
            f"| {r['run']} | {r['decode_tok_s']:.2f} {r.get('repeats_decode_tok_s', '')} | "
            f"{r['prefill_tok_s']:.2f} | {r['mib_per_token']:.1f} | "
            f"{100 * r['hit_rate']:.1f}% | {r['decode_read_gib_s']:.3f} | "
            f"{100 * r['decode_read_gib_s'] / ceiling:.0f}% | "
            f"{r['ms_per_token']:.0f} | {r['read_wait_ms_per_token']:.0f} | "
            f"{r.get('device_bytes_read', 0) / GiB:.1f} |"
        )
    if "resident" in results:
        direct = next((r for r in results["runs"] if r["run"].startswith("direct")), None)
        if direct:
            bound = max(direct["mib_per_token"] / 1024 / ceiling * 1000, results["resident"]["ms_per_token"])
            print(
                f"\ndirect: {direct['ms_per_token']:.0f} ms/token vs max(bytes/ceiling, compute-only) = "
                f"{bound:.0f} ms/token -> ratio {direct['ms_per_token'] / bound:.2f} (target <= 1.2)"
            )
    texts = {tuple(r["tokens"]) for r in results["runs"]}
    print(f"identical tokens across runs: {'yes' if len(texts) == 1 else 'NO'}")


if __name__ == "__main__":
    main()
