"""CUDA benchmark, side by side in one run (for the GPU machine; needs root to drop the page cache).

  1. the raw O_DIRECT ceiling of the disk holding the checkpoint (benchmarks/io_ceiling.py);
  2. moestream --device cuda at each GPU budget (host cache 0: pinned staging only);
  3. all experts resident in pinned host memory (host cache = all experts, second pass: the upper bound);
  4. transformers + accelerate with disk offload (device_map + offload_folder), what a Python user
     would pick today.
Each run starts from a dropped page cache. Output: one JSON line per run, then a Markdown table.

    python benchmarks/cuda_bench.py CHECKPOINT --gpu-budgets 2GiB,8GiB,24GiB --tokens 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from io_ceiling import expert_ranges, measure

PROMPT = "The history of the printing press shows how a new machine can change the way people"

MOESTREAM = """
import json, sys, moestream
path, gpu, host, tokens, passes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
prefetch, io_threads = sys.argv[7] == "1", int(sys.argv[8])
with moestream.load(path, device="cuda", cache=gpu, gpu_cache=gpu, host_cache=host, prefetch=prefetch,
                    io_threads=io_threads) as e:
    mode = e.mode_line()
    for _ in range(passes):
        out = e.generate(sys.argv[6], max_tokens=tokens, ignore_eos=True)
    s = out.stats.to_dict()
    s["host_syncs"] = e.runtime.tier.stats.host_syncs
    print(json.dumps({"mode": mode, "stats": s, "tokens": out.tokens}))
"""

ACCELERATE = """
import json, os, sys, time, torch, transformers as T

def drop():
    os.sync()
    open("/proc/sys/vm/drop_caches", "w").write("3")

class Clock(T.LogitsProcessor):
    # called once per generated token: note the time, then drop the page cache (not timed) so every
    # token reads its offloaded experts from disk, as on a machine whose RAM cannot hold the model
    def __init__(self):
        self.marks, self.dropped = [], 0.0
    def __call__(self, input_ids, scores):
        self.marks.append(time.perf_counter() - self.dropped)
        t = time.perf_counter()
        drop()
        self.dropped += time.perf_counter() - t
        return scores

path, tokens, offload = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tok = T.AutoTokenizer.from_pretrained(path)
t0 = time.perf_counter()
model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
    max_memory={0: "4GiB", "cpu": "4GiB"}, offload_folder=offload)
load_s = time.perf_counter() - t0
drop()  # the offload folder was just written and sits in the page cache
ids = torch.tensor([tok.encode(sys.argv[4], add_special_tokens=False)], device="cuda:0")
clock = Clock()
start = time.perf_counter()
out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                     logits_processor=T.LogitsProcessorList([clock]))
m = clock.marks
print(json.dumps({"load_s": load_s, "prefill_tok_s": ids.shape[1] / (m[0] - start),
                  "decode_tok_s": (len(m) - 1) / (m[-1] - m[0]), "step_s": [b - a for a, b in zip(m, m[1:])],
                  "tokens": out[0, ids.shape[1]:].tolist()}))
"""


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def child(code: str, *args: str, timeout: float) -> dict:
    drop_caches()
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:], "wall_s": time.perf_counter() - start}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    return result


def table(runs: dict) -> str:
    """Markdown table of a results file's runs; % of ceiling against the mean of the ceilings measured."""
    ceilings = [v["gib_s"] for k, v in runs.items() if k.startswith("ceiling") and "gib_s" in v]
    ceiling = sum(ceilings) / len(ceilings) if ceilings else None
    accel = next((v for k, v in runs.items() if k.startswith("transformers") and "decode_tok_s" in v), None)
    lines = [
        f"O_DIRECT ceiling (mean of {len(ceilings)}: {', '.join(f'{c:.3f}' for c in ceilings)}): "
        f"{ceiling:.3f} GiB/s"
        if ceiling
        else "no ceiling measured",
        "",
        "| run | decode tok/s | prefill tok/s | MiB read/token (decode) | read GiB/s while decoding | % of "
        "ceiling "
        "| not read from disk | host syncs | decode vs accelerate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in runs.items():
        if "stats" not in v:
            continue
        st, dec = v["stats"], v["stats"]["decode"]
        gib_s = dec["bytes_read"] / dec["seconds"] / 2**30
        pct = f"{100 * gib_s / ceiling:.0f}%" if ceiling else ""
        vs = f"{st['decode_tok_s'] / accel['decode_tok_s']:.1f}x" if accel else ""
        lines.append(
            f"| {name} | {st['decode_tok_s']:.2f} | {st['prefill_tok_s']:.2f} | "
            f"{dec['bytes_read'] / dec['tokens'] / 2**20:.0f} | {gib_s:.3f} | {pct} | "
            f"{st['hit_rate']:.1%} | {st.get('host_syncs', '')} | {vs} |"
        )
    if accel:
        lines.append(
            f"| transformers + accelerate, disk offload | {accel['decode_tok_s']:.3f} | "
            f"{accel['prefill_tok_s']:.2f} | all experts | | | | | 1.0x |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "checkpoint", help="the checkpoint, or with --table, results files (cuda_bench.json) to merge"
    )
    p.add_argument("--table", action="store_true", help="print the Markdown table of results files and exit")
    p.add_argument("--gpu-budgets", default="2GiB,8GiB,24GiB")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--accelerate-tokens", type=int, default=3)
    p.add_argument("--io-threads", type=int, default=4, help="moestream's I/O threads and the ceiling's")
    p.add_argument("--prefetch-budgets", default="", help="GPU budgets to run again with --prefetch")
    p.add_argument("--skip", default="", help="comma list of: ceiling,moestream,switch,resident,accelerate")
    p.add_argument("--out", default=".")
    args, extra = p.parse_known_args()
    if args.table:
        runs: dict = {}
        for path in [args.checkpoint, *extra]:
            runs.update(json.loads(Path(path).read_text())["runs"])
        print(table(runs))
        return
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    out = Path(args.out)
    skip = set(args.skip.split(","))
    results: dict = {"checkpoint": args.checkpoint, "runs": {}}

    def record(name: str, value: dict) -> None:
        results["runs"][name] = value
        print(json.dumps({name: {k: v for k, v in value.items() if k != "tokens"}}), flush=True)
        (out / "cuda_bench.json").write_text(json.dumps(results, indent=1))

    if "ceiling" not in skip:
        drop_caches()
        record("ceiling", measure(expert_ranges(args.checkpoint), 128 * 1024, args.io_threads, 10.0))
    if "moestream" not in skip:
        for budget in args.gpu_budgets.split(","):
            record(
                f"moestream gpu {budget}",
                child(
                    MOESTREAM,
                    args.checkpoint,
                    budget,
                    "0",
                    str(args.tokens),
                    "1",
                    PROMPT,
                    "0",
                    str(args.io_threads),
                    timeout=300,
                ),
            )
    for budget in filter(None, args.prefetch_budgets.split(",")):
        record(
            f"moestream gpu {budget} --prefetch",
            child(
                MOESTREAM,
                args.checkpoint,
                budget,
                "0",
                str(args.tokens),
                "1",
                PROMPT,
                "1",
                str(args.io_threads),
                timeout=300,
            ),
        )
    if "switch" not in skip:  # A/B: CPython's default 5 ms GIL switch interval
        os.environ["MOESTREAM_SWITCH_INTERVAL"] = "0"
        record(
            "moestream gpu 2GiB, default GIL switch interval",
            child(
                MOESTREAM,
                args.checkpoint,
                "2GiB",
                "0",
                str(args.tokens),
                "1",
                PROMPT,
                "0",
                str(args.io_threads),
                timeout=300,
            ),
        )
        del os.environ["MOESTREAM_SWITCH_INTERVAL"]
    if "resident" not in skip:
        record(
            "all experts in pinned host memory",
            child(
                MOESTREAM,
                args.checkpoint,
                "2GiB",
                "64GiB",
                str(args.tokens),
                "2",
                PROMPT,
                "0",
                str(args.io_threads),
                timeout=400,
            ),
        )
    if "ceiling" not in skip:  # again at the end: the disk's drift over the run
        drop_caches()
        record("ceiling (after)", measure(expert_ranges(args.checkpoint), 128 * 1024, args.io_threads, 10.0))
    if "accelerate" not in skip:
        record(
            "transformers+accelerate disk offload",
            child(
                ACCELERATE,
                args.checkpoint,
                str(args.accelerate_tokens),
                str(out / "offload"),
                PROMPT,
                timeout=400,
            ),
        )
    print(table(results["runs"]), flush=True)


if __name__ == "__main__":
    main()
