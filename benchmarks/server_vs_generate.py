"""Decode speed through `moestream serve` against `moestream generate`, on the same prompts.

Every run is a fresh process with a cold expert cache, so both sides read the same experts: for each
round and prompt, `moestream generate --json` once, then a fresh `moestream serve` answering one
streamed /v1/completions request (greedy, ignore_eos, the same max_tokens), then the server stops.

Like with like: generate's decode tok/s is decode.tokens / decode.seconds = (N - 1) tokens over the time
after the first token; from the server's llama-server timings the same figure is
(predicted_n - 1) / predicted_ms (its own predicted_per_second, N / predicted_ms, counts the first token
too, as llama.cpp does). Also reported: the request time the client saw, against generate's engine time
(prefill + decode), which is what HTTP, SSE and the worker hand-off add.

    python benchmarks/server_vs_generate.py CHECKPOINT [--cache 128MiB] [--tokens 32] [--rounds 2] \
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime

import httpx

PROMPTS = [
    "The history of the printing press shows how a new machine can change",
    "Explain why the sky is blue in one paragraph.",
    "List three uses of a mixture of experts model:",
]


def run_generate(args: argparse.Namespace, prompt: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "moestream",
        "generate",
        args.checkpoint,
        "--prompt",
        prompt,
        "--max-tokens",
        str(args.tokens),
        "--ignore-eos",
        "--cache",
        args.cache,
        "--json",
        *args.engine,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    s = out["stats"]
    return {
        "decode_tok_s": s["decode_tok_s"],
        "engine_s": s["prefill"]["seconds"] + s["decode"]["seconds"],
        "text": out["text"],
        "tokens": len(out["tokens"]),
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    argv = [
        sys.executable,
        "-m",
        "moestream",
        "serve",
        args.checkpoint,
        "--port",
        "0",
        "--cache",
        args.cache,
        *args.engine,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        match = re.search(r"on (http://\S+)/v1", line)
        if match:
            return proc, match.group(1)
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def run_server(args: argparse.Namespace, prompt: str) -> dict:
    proc, url = start_server(args)
    try:
        body = {
            "prompt": prompt,
            "max_tokens": args.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, last = [], None
        with httpx.Client(base_url=url, timeout=600) as client:
            sent = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as res:
                for line in res.iter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
                        text.append(last["choices"][0]["text"])
            seen_s = time.perf_counter() - sent
    finally:
        proc.terminate()
        proc.wait(60)
    t = last["timings"]
    return {
        "decode_tok_s": 1000 * (t["predicted_n"] - 1) / t["predicted_ms"],
        "predicted_per_second": t["predicted_per_second"],
        "client_s": seen_s,
        "engine_s": (t["prompt_ms"] + t["predicted_ms"]) / 1000,
        "text": "".join(text),
        "tokens": t["predicted_n"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--cache", default="128MiB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--engine", nargs=argparse.REMAINDER, default=[], help="more engine options for both sides"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(
        f"date {datetime.now().isoformat(timespec='seconds')}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; Python {platform.python_version()}; cache {args.cache}, {args.tokens} "
        "tokens"
    )
    rows = []
    for round_ in range(args.rounds):
        for i, prompt in enumerate(PROMPTS):
            gen, srv = run_generate(args, prompt), run_server(args, prompt)
            rows.append({"round": round_, "prompt": i, "generate": gen, "server": srv})
            print(
                json.dumps(
                    {
                        "round": round_,
                        "prompt": i,
                        "generate_tok_s": round(gen["decode_tok_s"], 3),
                        "server_tok_s": round(srv["decode_tok_s"], 3),
                        "same_text": gen["text"] == srv["text"],
                    }
                ),
                flush=True,
            )
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def report(rows: list[dict]) -> None:
    print(
        "\n| round | prompt | generate decode tok/s | server decode tok/s | ratio | server "
        "predicted_per_second "
        "| generate engine s | server request s (client) | same text |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g, s = r["generate"], r["server"]
        print(
            f"| {r['round']} | {r['prompt']} | {g['decode_tok_s']:.2f} | {s['decode_tok_s']:.2f} | "
            f"{s['decode_tok_s'] / g['decode_tok_s']:.3f} | {s['predicted_per_second']:.2f} | "
            f"{g['engine_s']:.2f} | "
            f"{s['client_s']:.2f} | {'yes' if g['text'] == s['text'] else 'NO'} |"
        )
    g_mean = statistics.mean(r["generate"]["decode_tok_s"] for r in rows)
    s_mean = statistics.mean(r["server"]["decode_tok_s"] for r in rows)
    ratios = [r["server"]["decode_tok_s"] / r["generate"]["decode_tok_s"] for r in rows]
    overhead = [r["server"]["client_s"] - r["server"]["engine_s"] for r in rows]
    print(
        f"\nmean decode tok/s: generate {g_mean:.2f}, server {s_mean:.2f}; server/generate "
        f"{s_mean / g_mean:.3f} "
        f"(per-pair median {statistics.median(ratios):.3f}; target >= 0.95)"
    )
    print(
        "client-seen request time minus the server's engine time: median "
        f"{1000 * statistics.median(overhead):.1f} ms"
    )


if __name__ == "__main__":
    main()
