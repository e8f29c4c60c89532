"""The ggml graphs on ggml's CUDA backend (issue 31): correctness on tiny models, then speed against
llama.cpp on the same GGUF, every expert in VRAM.

    # correctness: each family's tiny model, logits on CUDA against stock transformers fp32 and the
    # CPU graphs (tolerance: other kernels, activations quantized otherwise), and CUDA twice (bit equal)
    MOESTREAM_GGML_LIB=<folder with libggml-cuda> python benchmarks/ggml_cuda.py check
    # speed: prefill of P-token prompts and decode of N tokens, warm, greedy, in-process; Python's share
    # of a decoded token (the wall time outside the graph's compute and copies)
    MOESTREAM_GGML_LIB=... python benchmarks/ggml_cuda.py speed MODEL.gguf --prompts 36,512 --tokens 32
    # the same with a GPU tier of 2 GiB (the host cache holds every expert): also its hit rate and the
    # bytes uploaded to it per decoded token
    MOESTREAM_GGML_LIB=... python benchmarks/ggml_cuda.py speed MODEL.gguf --gpu-tier 2GiB
    # its misses computed by the CPU from the host cache instead of copied first (MOESTREAM_TIER_MISSES;
    # auto: the faster of the two in a trial of the first 16 decoded tokens)
    MOESTREAM_GGML_LIB=... python benchmarks/ggml_cuda.py speed MODEL.gguf --gpu-tier 2GiB --tier-misses host
    # bigger than RAM and VRAM together: a host cache smaller than the experts, the misses of both tiers
    # read from disk; the bytes read per decoded token, the read rate while decoding, and the disk's
    # O_DIRECT ceiling for this checkpoint (benchmarks/io_ceiling.py) measured before the load and after
    # the runs, in the same process
    MOESTREAM_GGML_LIB=... python benchmarks/ggml_cuda.py speed MODEL.gguf --cache 5GiB --gpu-tier 2GiB \
        --ceiling 10
    # the same with the next layer's confident stale-gate guesses read into the host cache while a layer's
    # misses are copied and computed (--prefetch on|auto; the decode's prefetches and those used)
    MOESTREAM_GGML_LIB=... python benchmarks/ggml_cuda.py speed MODEL.gguf --cache 5GiB --gpu-tier 2GiB \
        --ceiling 10 --prefetch on

Runs with MOESTREAM_GGML_BACKEND=cuda set by itself (`--backend cpu`: ggml's CPU backend, to check the
script here). Prints one JSON line per result and a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import moestream  # noqa: E402
from moestream.engine.ggml_runner import GgmlRunner  # noqa: E402
from moestream.engine.gpu_tier import GpuTier  # noqa: E402
from moestream.engine.host_misses import HostMisses  # noqa: E402
from moestream.ggml.backend import Backend  # noqa: E402
from moestream.ggml.net import Net  # noqa: E402
from moestream.runtime.expert_layers import ExpertLayers  # noqa: E402

FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "qwen3_next",
    "qwen3_5_moe",
]
# the tiny models' shapes changed to what ggml's CUDA flash attention has kernels for (head dims 64,
# 128, 256; DeepSeek's latent 512 + rope 64), as real models of these families have
HEAD_64 = dict(head_dim=64)
MLA_576 = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    qk_head_dim=128,
    head_dim=64,
    num_key_value_heads=4,
)
ONE_HEAD = dict(num_attention_heads=1, num_key_value_heads=1, head_dim=64)  # head dim = hidden (64)
CUDA_SHAPES = {"deepseek_v2": MLA_576, "deepseek_v3": MLA_576, "olmoe": ONE_HEAD}
PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
FORCED = [9, 150, 77, 31, 200, 6, 18, 42]


class Phases:
    """Where a decoded token's wall time goes, each part exclusive of the parts it calls: `graphs` (a
    graph's run: its copies in and out, its compute, on a backend its wait), `sync` (the backend's
    waits outside a graph's run: a GPU tier's copies), `upload` (issuing a GPU tier's copies), `cpu` (a
    GPU tier's misses computed on the CPU: the host graph or the expert runtime), `step` (the runner's
    own Python inside a step), and what is left of the span from the first step's start to the last
    one's end: the engine's loop between steps (sampling, stop checks, stats). Counted over the one-token
    steps only (decode), by wrapping the classes' methods for the whole process. The span is its own, not
    the decode's seconds: a step started ahead (`launch`) for the first decoded token starts before the
    engine's decode clock, which on the CPU backend computes it whole there (the engine's share came out
    negative, 12-07)."""

    WRAPPED = (
        (Net, "run", "graphs"),
        (Net, "launch", "graphs"),  # a step started ahead's graph (`run` calls it too: counted once)
        (Backend, "synchronize", "sync"),
        (GpuTier, "upload", "upload"),
        (HostMisses, "compute", "cpu"),
        (ExpertLayers, "compute", "cpu"),
    )

    def __init__(self) -> None:
        self.on, self.stack, self.steps = False, [], 0
        self.seconds: dict[str, float] = {}
        for owner, name, key in self.WRAPPED:
            setattr(owner, name, self._timed(getattr(owner, name), key))
        call = GgmlRunner.__call__

        def step(runner, ids, cache, greedy=False):
            if len(ids) != 1:  # a prompt's chunk (or a batch's): not counted
                return call(runner, ids, cache, greedy)
            self.steps += 1
            return self._counted(call, runner, ids, cache, greedy)

        GgmlRunner.__call__ = step
        started = GgmlRunner.launch

        def launch(runner, ids, cache, greedy=False):  # a step started ahead: its start and its end
            done = self._counted(started, runner, ids, cache, greedy)
            if done is None:
                return None
            self.steps += 1
            return lambda: self._counted(done)

        GgmlRunner.launch = launch
        self.reset()

    def reset(self) -> None:
        self.seconds = {key: 0.0 for key in ["graphs", "sync", "upload", "cpu", "step"]}
        self.steps = 0
        self.first: float | None = None  # the first counted call's start, the last one's end
        self.last = 0.0

    def _counted(self, fn, *args):
        """`fn(*args)`, a decoded token's step or part of one: its time counted, its own Python as `step`."""
        self.on = True
        if self.first is None:
            self.first = time.perf_counter()
        try:
            return self._timed(fn, "step")(*args)
        finally:
            self.on = False
            self.last = time.perf_counter()

    def _timed(self, fn, key: str):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self.stack.append(0.0)  # the time of the wrapped calls inside this one
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                self.seconds[key] += took - self.stack.pop()
                if self.stack:
                    self.stack[-1] += took

        return timed

    def per_token(self) -> dict:
        """ms per decoded token's step in each part, `engine` the span's seconds outside the steps."""
        steps = max(self.steps, 1)
        ms = {k: round(1e3 * v / steps, 3) for k, v in self.seconds.items()}
        span = self.last - self.first if self.first is not None else 0.0
        ms["engine"] = round(1e3 * (span - sum(self.seconds.values())) / steps, 3)
        return ms


def _logits(path: Path, backend: str) -> torch.Tensor:
    """Prefill PROMPT, then one step per FORCED token: [1 + n, V] (as tests/test_ggml_runner.py)."""
    if backend:
        os.environ["MOESTREAM_GGML_BACKEND"] = backend
    else:
        os.environ.pop("MOESTREAM_GGML_BACKEND", None)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        return _forced(engine, PROMPT, FORCED)


def check(args: argparse.Namespace) -> None:
    import transformers as T
    from tiny_models import write_tiny

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.families.split(","):
            path = write_tiny(arch, Path(tmp) / arch, **CUDA_SHAPES.get(arch, HEAD_64))
            extra = {"quantization_config": T.Mxfp4Config(dequantize=True)} if "mxfp4" in arch else {}
            model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).float().eval()
            with torch.inference_mode():
                stock = model(torch.tensor([PROMPT + FORCED])).logits[0][len(PROMPT) - 1 :]
            row = {"arch": arch}
            try:
                cpu = _logits(path, "")
                dev = _logits(path, args.backend)
                again = _logits(path, args.backend)
                scale = stock.abs().max().item()
                row.update(
                    device_vs_stock=round((dev - stock).abs().max().item() / scale, 5),
                    cpu_vs_stock=round((cpu - stock).abs().max().item() / scale, 5),
                    device_vs_cpu=round((dev - cpu).abs().max().item() / scale, 5),
                    argmax_equal_cpu=int((dev.argmax(-1) == cpu.argmax(-1)).sum()),
                    steps=dev.shape[0],
                    repeatable=bool(torch.equal(dev, again)),
                )
            except Exception as exc:  # a family that fails is reported, the rest go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'arch':<14} {'dev/stock':>10} {'cpu/stock':>10} {'dev/cpu':>9} {'argmax=':>8} repeat")
    for r in rows:
        if "error" in r:
            print(f"{r['arch']:<14} ERROR {r['error']}")
        else:
            print(
                f"{r['arch']:<14} {r['device_vs_stock']:>10} {r['cpu_vs_stock']:>10} {r['device_vs_cpu']:>9} "
                f"{r['argmax_equal_cpu']:>5}/{r['steps']:<2} {r['repeatable']}"
            )


def speed(args: argparse.Namespace) -> None:
    os.environ["MOESTREAM_GGML_BACKEND"] = args.backend
    if not args.start_ahead:  # every step called when its token is in (no step started ahead)
        GgmlRunner.launch = lambda runner, ids, cache, greedy=False: None
    phases = Phases()
    run = Net.run
    ceiling = _ceiling(args)
    t0 = time.perf_counter()
    tier = {"gpu_tier": args.gpu_tier} if args.gpu_tier else {}
    if args.gpu_tier:
        os.environ["MOESTREAM_TIER_MISSES"] = args.tier_misses
    options = dict(cache=args.cache, trunk="ggml", threads=args.threads, **tier)
    options.update(io_mode=args.io_mode, io_threads=args.io_threads, piece=args.piece, prefetch=args.prefetch)
    with moestream.load(args.model, **options) as engine:
        load_s = time.perf_counter() - t0
        print(engine.mode_line(), flush=True)
        vocab = engine.runner.spec.vocab
        gen = torch.Generator().manual_seed(0)
        results = {"load_s": round(load_s, 1)}
        tokens, forced = {}, {}
        for n in [int(x) for x in args.prompts.split(",")]:
            prompt = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
            for _ in range(args.warmup):
                engine.generate(prompt, max_tokens=args.tokens, ignore_eos=True)
            best_prefill, decode, share, tiers, runs = 0.0, [], [], [], []
            for _ in range(args.repeats):
                phases.reset()
                out = engine.generate(prompt, max_tokens=args.tokens, ignore_eos=True)
                s = out.stats
                best_prefill = max(best_prefill, s.prefill.tok_s)
                if s.device_tier is not None:
                    tiers.append(s.device_tier)
                decode.append(s.decode.tok_s)
                # the decode's steps (one-token runner calls: the first decoded token comes from the
                # prompt's last chunk, so one fewer than the decode's tokens)
                ms = phases.per_token()
                runs.append((s.decode, ms))
                # Python's share: the steps' span's wall time outside the graphs' runs, the backend's
                # waits, the tier's copies and the CPU's share of its misses
                busy = sum(ms[k] for k in ("graphs", "sync", "upload", "cpu"))
                share.append(max(0.0, 1 - busy / (ms["engine"] + busy + ms["step"])) if phases.steps else 0.0)
            median_phase, median_ms = sorted(runs, key=lambda r: r[0].tok_s)[len(runs) // 2]
            row = {
                "prompt_tokens": n,
                "prefill_tok_s": round(best_prefill, 1),
                "decode_tok_s": round(sorted(decode)[len(decode) // 2], 1),
                "decode_runs": [round(d, 1) for d in decode],
                "python_share_decode": round(sorted(share)[len(share) // 2], 3),
                "decode_ms_per_step": median_ms,  # the median run's, by part (Phases)
            }
            if tiers:  # the GPU tier: hit rate while decoding, MiB uploaded per decoded token (last run)
                row["tier_decode_hit_rate"] = round(tiers[-1]["decode_hit_rate"], 4)
                row["tier_mib_per_token"] = round(tiers[-1]["decode_mib_uploaded_per_token"], 2)
                row["tier_prefill_and_decode_gib"] = round(tiers[-1]["bytes_uploaded"] / 2**30, 3)
                row["bytes_read_from_disk"] = s.bytes_read
            trial = getattr(engine.runner.tiered, "trial", None)
            if trial is not None:  # MOESTREAM_TIER_MISSES=auto: the way chosen, and the steps' times
                row["tier_way"] = trial.describe()
            row.update(_reads(median_phase))  # the median run's
            print(json.dumps(row), flush=True)
            results[f"p{n}"] = row
            tokens[n] = (prompt, out.tokens[: args.compare])
            if args.compare:  # the device's logits along its own greedy tokens, for the CPU graphs' below
                forced[n] = _forced(engine, prompt, tokens[n][1][:-1])
        results["decode_step"] = _profile(engine.runner, run)
        print(json.dumps(results["decode_step"]), flush=True)
    if ceiling:  # the disk again, after the runs: the higher of the two is the ceiling
        ceiling.append(_ceiling(args)[0])
        results["o_direct_ceiling_gib_s"] = [round(c, 3) for c in ceiling]
        for key, row in results.items():
            if key.startswith("p") and "decode_read_gib_s" in row:
                row["decode_read_of_ceiling"] = round(row["decode_read_gib_s"] / max(ceiling), 3)
        print(json.dumps({"o_direct_ceiling_gib_s": results["o_direct_ceiling_gib_s"]}), flush=True)
    if args.compare:  # the same greedy tokens from the CPU graphs (ggml's CPU backend in place)
        os.environ.pop("MOESTREAM_GGML_BACKEND")
        os.environ.pop("MOESTREAM_TIER_MISSES", None)
        with moestream.load(args.model, cache=args.cache, trunk="ggml", threads=args.threads) as engine:
            for n, (prompt, theirs) in tokens.items():
                ours = engine.generate(prompt, max_tokens=args.compare, ignore_eos=True).tokens
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
                results[f"p{n}"]["cpu_tokens_equal"] = "all" if same is None else f"first {same}"
                print(f"p{n}: {args.compare} greedy tokens, device vs CPU graphs: first unequal {same}")
                row = _logit_gap(forced[n], _forced(engine, prompt, theirs[:-1]), theirs, same)
                results[f"p{n}"].update(row)
                print(f"p{n}: logits along the device's tokens, device vs CPU graphs: {json.dumps(row)}")
    print(json.dumps(results))


def _forced(engine, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """Teacher-forced logits: the prompt's prefill, then a step per `fed` token; [1 + len(fed), V] f32,
    a fresh KV cache. The logits that chose greedy `tokens` are those fed tokens[:-1]."""
    step = engine.runner
    logits, kv = step(prompt, None)
    out = [logits.float().clone()]
    for token in fed:
        logits, kv = step([token], kv)
        out.append(logits.float().clone())
    return torch.stack(out)


def _logit_gap(dev: torch.Tensor, cpu: torch.Tensor, tokens: list[int], first: int | None) -> dict:
    """How far the device's logits are from the CPU graphs' along the same tokens (max |difference| over
    the CPU's largest |logit|), how many steps pick the same argmax, and where the greedy tokens part,
    how close the CPU's own choice was there: its top logit less its logit of the device's token, over
    the same scale (a near tie when that is within the logits' difference)."""
    scale = cpu.abs().max().item()
    row = {
        "logits_vs_cpu": round((dev - cpu).abs().max().item() / scale, 5),
        "forced_argmax_equal": f"{int((dev.argmax(-1) == cpu.argmax(-1)).sum())}/{len(tokens)}",
    }
    if first is not None:
        c, d = cpu[first], dev[first]
        row["cpu_margin_at_first_unequal"] = round((c.max() - c[tokens[first]]).item() / scale, 5)
        row["device_margin_at_first_unequal"] = round((d.max() - d[c.argmax()]).item() / scale, 5)
    return row


def _reads(decode) -> dict:
    """What the decode phase read from disk: bytes per decoded token and the rate while decoding."""
    if not decode.tokens or not decode.seconds:
        return {}
    return {
        "decode_mib_read_per_token": round(decode.bytes_read / decode.tokens / 2**20, 2),
        "decode_read_gib_s": round(decode.bytes_read / decode.seconds / 2**30, 3),
        "decode_read_wait_ms_per_token": round(1e3 * decode.read_wait_s / decode.tokens, 2),
        "decode_prefetches": decode.prefetches,  # experts read ahead (--prefetch), and of those used
        "decode_prefetch_used": decode.prefetch_used,
    }


def _ceiling(args: argparse.Namespace) -> list[float]:
    """The disk's O_DIRECT rate (GiB/s) reading this checkpoint's experts as the cache reads them (its
    io threads and pieces; `benchmarks/io_ceiling.py`), over `--ceiling` seconds; none when 0."""
    if not args.ceiling:
        return []
    from io_ceiling import expert_ranges, measure

    from moestream.units import parse_size

    result = measure(expert_ranges(args.model), parse_size(args.piece), args.io_threads, args.ceiling)
    print(json.dumps({"o_direct_ceiling": result}), flush=True)
    return [result["gib_s"]]


def _profile(runner, run, n: int = 100) -> dict:
    """Where a decoded token's time goes: the decode step's one graph (the last one used) run `n` times
    with its copies (`Net.run`; `_greedy`: with the logits' argmax copied back in their place), its
    compute alone (the graph replayed, no copies) and its copies alone; its node count and how many
    copies of how many bytes go each way."""
    nets = [gs.whole[1] for (t, *_), gs in runner._sets.items() if t == 1 and gs.whole is not None]
    if not nets:
        return {}
    net = nets[-1]
    memory, lib = net.memory, net.lib
    backend = memory.backend

    def per_call(f) -> float:
        f()
        backend.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        backend.synchronize()
        return round((time.perf_counter() - t0) / n * 1e3, 4)

    def compute() -> None:
        backend.compute_async(net.gf)
        backend.synchronize()

    # what a step copies back: with its logits, or (a plainly greedy request's) their argmax instead
    fetched, greedy = net._outputs + net._later, net._outputs + net._instead

    def copies(downloads) -> None:
        for region, offset, nbytes in net._inputs:
            memory.upload(region, offset, nbytes)
        for region, offset, nbytes in downloads:
            memory.download(region, offset, nbytes)
        backend.synchronize()

    return {
        "nodes": lib.base.ggml_graph_n_nodes(net.gf),
        "uploads": [len(net._inputs), sum(x[2] for x in net._inputs)],
        "downloads": [len(fetched), sum(x[2] for x in fetched)],
        "downloads_greedy": [len(greedy), sum(x[2] for x in greedy)],
        "run_ms": per_call(lambda: run(net)),
        "run_greedy_ms": per_call(lambda: run(net, False)),
        "compute_ms": per_call(compute),
        "copies_ms": per_call(lambda: copies(fetched)),
        "copies_greedy_ms": per_call(lambda: copies(greedy)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--families", default=",".join(FAMILIES))
    c.add_argument("--backend", default="cuda")
    s = sub.add_parser("speed")
    s.add_argument("model")
    s.add_argument("--prompts", default="36,512")
    s.add_argument("--tokens", type=int, default=32)
    s.add_argument(
        "--cache",
        default="12GiB",
        help="the host expert cache: room for every expert (read at load), or less (misses read from disk)",
    )
    s.add_argument("--io-mode", default="direct", choices=["direct", "pagecache", "mmap"])
    s.add_argument("--io-threads", type=int, default=4)
    s.add_argument("--piece", default="128KiB")
    s.add_argument(
        "--ceiling", type=float, default=0, help="seconds of the disk's O_DIRECT ceiling, before and after"
    )
    s.add_argument("--threads", type=int, default=8)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--backend", default="cuda")
    s.add_argument("--gpu-tier", default=None, help="device slots for the experts (default: every expert)")
    ways = ["upload", "host", "split", "auto"]
    s.add_argument("--tier-misses", default="upload", choices=ways, help="with --gpu-tier")
    s.add_argument(
        "--prefetch", default="off", choices=["off", "on", "auto"], help="the stale-gate read-ahead"
    )
    s.add_argument("--compare", type=int, default=16, help="greedy tokens to compare with the CPU graphs")
    s.add_argument(
        "--start-ahead",
        type=int,
        default=1,
        choices=[0, 1],
        help="1: a greedy token's next step started before the token is handed out (the engine's); 0: not",
    )
    args = p.parse_args()
    check(args) if args.cmd == "check" else speed(args)


if __name__ == "__main__":
    main()
