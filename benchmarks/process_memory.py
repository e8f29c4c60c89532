"""Where a streaming process's memory goes (issue 31, item 6): /proc/self/status's RssAnon and RssFile
after `import torch`, after moestream's imports, after the load and after a few decoded tokens; the
largest mappings by resident bytes (/proc/self/smaps); whether torch's CUDA was initialized (on ggml's
CUDA backend it should not be: everything there is ggml's).

    python benchmarks/process_memory.py MODEL.gguf --device cuda --cache 1GiB --gpu-tier 2GiB --tokens 8

One JSON line at the end ("stages", "largest", "torch_cuda_initialized"); the stages also as they come.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moestream.engine.memory import process_status  # imports no torch: the stages below stay apart

MIB = 1 << 20


def status() -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of this process, MiB."""
    st = process_status()
    return {name: int(st[name].split()[0]) // 1024 for name in ("RssAnon", "RssFile", "VmHWM") if name in st}


def largest(n: int = 12) -> list[tuple[str, int]]:
    """The n mappings (by name; anonymous ones as '[anon]') holding the most resident MiB."""
    sizes: dict[str, int] = {}
    name = "[anon]"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            name = fields[5] if len(fields) > 5 else "[anon]"
        elif fields and fields[0] == "Rss:":
            sizes[name] = sizes.get(name, 0) + int(fields[1]) * 1024
    return [(k, v // MIB) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", default="1GiB")
    parser.add_argument("--gpu-tier", default=None)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    stages: list[tuple[str, dict[str, int]]] = []

    def mark(stage: str) -> None:
        stages.append((stage, status()))
        print(f"{stage:28s} {stages[-1][1]}", flush=True)

    mark("start")
    import torch

    mark("import torch")
    import moestream

    mark("import moestream")
    options = {"cache": args.cache, "device": args.device}
    if args.gpu_tier:
        options["gpu_tier"] = args.gpu_tier
    if args.threads:
        options["threads"] = args.threads
    with moestream.load(args.model, **options) as engine:
        mark("loaded")
        engine.generate(list(range(3, 40)), max_tokens=args.tokens, ignore_eos=True)
        mark(f"37 + {args.tokens} tokens")
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mark("malloc_trim(0)")
        result = {
            "stages": stages,
            "largest": largest(),
            "torch_cuda_initialized": bool(torch.cuda.is_available() and torch.cuda.is_initialized()),
            "mode": engine.mode_line(),
        }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
