"""llama.cpp's llama-server and `moestream serve` side by side, through the same harness (`moestream bench`'s
run_bench): same prompts, same greedy token count, same cgroup memory limit, the page cache dropped
before every run, the disk's readahead set per run, bytes read from the disk counted per request.

    # one run per SPEC: "llama:ra=8192,t=2" or
    # "moestream:io=direct,ra=8192,cache=1GiB,threads=2,io_threads=4,k=8"
    # GPU: "llama:ngl=99,ot=exps=CPU,t=8" and "moestream:device=cuda,gpu_cache=2GiB,host_cache=0"
    python benchmarks/llamacpp/side_by_side.py run SPEC... --llama-server BIN --gguf FILE --model DIR \
        --memory-limit 2.6GiB --max-tokens 32 --out DIR [--baseline RUN_DIR]
    # the table of every run under DIR, speed-ups against the best llama run, texts against a reference run
    python benchmarks/llamacpp/side_by_side.py table --out DIR [--reference RUN_DIR]
    # time/token against MiB/token over several runs (top-k 8 and a lossy top-k 4 span the line)
    python benchmarks/llamacpp/side_by_side.py fit RUN_DIR RUN_DIR... [--png fit.png]

Needs root (cgroup, drop_caches, read_ahead_kb). Options not in a SPEC keep each server's defaults:
llama-server uses mmap (its default path) with `-t` threads; moestream its own defaults.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from pathlib import Path

from moestream.bench.compare import compare_runs, load_baseline
from moestream.bench.harness import BenchConfig, run_bench
from moestream.bench.server import free_port, moestream_serve_argv
from moestream.units import parse_size

GiB = 1 << 30


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'llama:ra=8192,t=2' -> ('llama', {'ra': '8192', 't': '2'})."""
    kind, _, rest = spec.partition(":")
    if kind not in ("llama", "moestream"):
        raise SystemExit(f"unknown server kind in {spec!r} (llama or moestream)")
    opts = dict(item.split("=", 1) for item in rest.split(",") if item)
    return kind, opts


def llama_argv(binary: str, gguf: str, port: int, opts: dict[str, str]) -> list[str]:
    """llama-server with its default mmap path, one slot, no prompt cache kept in RAM, CPU only."""
    argv = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        opts.get("t", "2"),
        "-c",
        opts.get("ctx", "2048"),
        "-np",
        "1",
        "-ngl",
        opts.get("ngl", "0"),
        "--no-warmup",
    ]
    # GPU builds: ngl=99 with the routed experts kept on the CPU (streamed by mmap): ncmoe=N puts the
    # experts of the first N layers there (--n-cpu-moe), ot=exps=CPU every layer's (-ot)
    if "ncmoe" in opts:
        argv += ["--n-cpu-moe", opts["ncmoe"]]
    if "ot" in opts:
        argv += ["-ot", opts["ot"]]
    if opts.get("cache_ram", "0") != "none":
        argv += ["--cache-ram", opts.get("cache_ram", "0")]
    if opts.get("mmap", "on") == "off":
        argv.append("--no-mmap")
    # CPU builds repack Q4_K/Q4_0 weights into an anonymous buffer the size of the model by default, so they
    # are no longer streamed from the file (and do not fit a memory limit); repack=on keeps that default
    if opts.get("repack", "off") == "off":
        argv.append("--no-repack")
    return argv


def moestream_args(opts: dict[str, str]) -> list[str]:
    names = {
        "io": "--io-mode",
        "cache": "--cache",
        "threads": "--threads",
        "io_threads": "--io-threads",
        "piece": "--piece",
        "k": "--experts-per-token",
        "policy": "--policy",
        "ctx": "--ctx-size",
        "device": "--device",
        "gpu_cache": "--gpu-cache",
        "host_cache": "--host-cache",
        "trunk": "--trunk",
    }
    unknown = set(opts) - set(names) - {"ra", "prefetch", "model"}
    if unknown:
        raise SystemExit(
            f"unknown moestream option(s) {sorted(unknown)}; known: {sorted(names)}, prefetch, model and ra"
        )
    prefetch = opts.get("prefetch", "0")
    flags = (
        [] if prefetch in ("0", "off", "no") else ["--prefetch"] + ([prefetch] if prefetch == "auto" else [])
    )
    return [x for key, flag in names.items() if key in opts for x in (flag, opts[key])] + flags


def label_dir(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec)


def run_spec(spec: str, args: argparse.Namespace) -> dict:
    kind, opts = parse_spec(spec)
    port = free_port()
    if kind == "llama":
        argv, disk, name = llama_argv(args.llama_server, args.gguf, port, opts), args.gguf, "llama-server"
    else:
        model = opts.get("model", args.model)  # model=PATH: another checkpoint (bf16 of the same shape)
        argv, disk, name = moestream_serve_argv(model, port, moestream_args(opts)), model, "moestream"
    config = BenchConfig(
        out=Path(args.out) / label_dir(spec),
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        server_argv=argv,
        port=port,
        server_name=name,
        disk_of=disk,
        memory_limit=parse_size(args.memory_limit) if args.memory_limit else None,
        readahead_kb=int(opts["ra"]) if "ra" in opts else None,
        drop_caches=True,
        baseline=args.baseline if kind == "moestream" else None,
        label=spec,
        warmup=args.warmup,
    )
    results = run_bench(config)
    s = results["summary"]
    print(
        f"{spec}: decode {s['decode_tok_s_mean']:.3f} tok/s (CV {100 * (s['decode_tok_s_cv'] or 0):.1f}%), "
        f"prefill {s['prefill_tok_s_mean']:.2f} tok/s ({s['prompt_s_total']:.1f} s), read "
        f"{s['device_gib']:.1f} GiB, "
        f"peak memory {_peak(results)}{_held(results)}",
        flush=True,
    )
    return results


def _peak(results: dict) -> str:
    peak = results["machine"].get("cgroup", {}).get("peak_bytes")
    return f"{peak / GiB:.2f} GiB" if peak else "-"


def _held(results: dict) -> str:
    """What the group held at the end (memory.stat, v2): anonymous and file MiB, mapped files, refaults."""
    st = results["machine"].get("cgroup", {}).get("stat") or {}
    if not st:
        return ""
    mib = lambda k: f"{st.get(k, 0) >> 20}"  # noqa: E731
    return (
        f"; at the end anon {mib('anon')} MiB, file {mib('file')} MiB ({mib('file_mapped')} mapped), "
        f"{st.get('workingset_refault_file', 0)} file pages refaulted"
    )


def _same_text(run: dict, reference: dict | None) -> str:
    """'k/n' prompts whose text equals the reference run's, with the first differing characters."""
    if reference is None:
        return "-"
    diffs = compare_runs(run["requests"], reference)
    firsts = sorted(d.first_diff for d in diffs if not d.identical)
    return f"{sum(d.identical for d in diffs)}/{len(diffs)}" + (
        f" (first diff at chars {firsts})" if firsts else ""
    )


def table(out: Path, reference_dir: str | None = None) -> str:
    """Markdown: one row per run (oldest first), decode speed-up against the fastest llama run, and
    text equality against the reference run (e.g. moestream direct) when one is named."""
    runs = sorted(
        (json.loads(p.read_text(encoding="utf-8")) for p in out.glob("*/results.json")),
        key=lambda r: r["machine"]["date"],
    )
    reference = load_baseline(reference_dir) if reference_dir else None
    llama = [r["summary"]["decode_tok_s_mean"] for r in runs if r["server"] != "moestream"]
    best = max(llama) if llama else None
    lines = [
        "| run | decode tok/s (CV) | x best llama | prefill tok/s | prefill s (all) | GiB read | "
        "MiB/token | peak memory | text = reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["summary"]
        x = f"{s['decode_tok_s_mean'] / best:.2f}" if best else "-"
        same = _same_text(r, reference)
        lines.append(
            f"| {r['label']} | {s['decode_tok_s_mean']:.3f} ({100 * (s['decode_tok_s_cv'] or 0):.1f}%) | {x} "
            "| "
            f"{s['prefill_tok_s_mean']:.2f} | {s['prompt_s_total']:.1f} | {s['device_gib']:.1f} | "
            f"{s['mib_per_token_mean']:.0f} | {_peak(r)} | {same} |"
        )
    return "\n".join(lines)


def fit(run_dirs: list[str], png: str | None) -> str:
    """The time/token vs MiB/token line over the requests of several runs (e.g. top-k 8 and a lossy 4)."""
    from moestream.bench.plots import plot_fit
    from moestream.bench.report import fit_runs

    runs = [load_baseline(d) for d in run_dirs]
    line, points = fit_runs(runs)
    if png and points:
        plot_fit(points, line, png, " + ".join(r["label"] for r in runs))
    return line.line() if line else f"no fit: {len(points)} points without enough spread in MiB/token"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("specs", nargs="+")
    r.add_argument("--llama-server", default="/var/tmp/llamacpp/llama-server")
    r.add_argument("--gguf", default="/var/tmp/llamacpp/q12x64-bf16.gguf")
    r.add_argument("--model", default="/var/tmp/msb/q12x64")
    r.add_argument("--prompts", default="builtin")
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--memory-limit", default=None)
    r.add_argument(
        "--warmup",
        action="store_true",
        help="run every prompt once, uncounted, before the measured pass (compute only: llama.cpp's "
        "load reads the whole file, moestream's cache fills on the warm-up pass)",
    )
    r.add_argument("--baseline", default=None, help="results dir the moestream runs' texts are compared with")
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("--out", required=True)
    t.add_argument("--reference", default=None, help="results dir whose texts every run is compared with")
    f = sub.add_parser("fit")
    f.add_argument("runs", nargs="+", help="results dirs")
    f.add_argument("--png", default=None)
    args = p.parse_args()
    if args.cmd == "fit":
        print(fit(args.runs, args.png))
        return
    if args.cmd == "table":
        print(table(Path(args.out), args.reference))
        return
    # a plain kill still stops the server and removes the cgroup (the harness's finally blocks)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for spec in args.specs:
        run_spec(spec, args)


if __name__ == "__main__":
    main()
