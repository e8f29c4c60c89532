"""What a decode step of N rows must read, against one row's (issue 33, item 4): the bytes of a GGUF
file's weights that a step of N sequences touches, where each sequence's token routes to its own top-k
experts, and the ceiling that puts on N streams' aggregate decode where the step is bound by those bytes
(memory bandwidth in RAM): N x bytes(1) / bytes(N); and where only the routed experts are read (streamed
from disk, the trunk resident, a cache holding the same share of every layer's experts for one row as for
N): N x k / distinct(N).

    python benchmarks/batch_bytes.py MODEL.gguf [--rows 1,2,4,8] [--trace TRACE [TRACE ...]]

A step reads every layer's trunk once (attention, norms, routers, shared experts), the output head once,
and each distinct routed expert once (the union of the rows' experts: llama.cpp and moestream alike
compute each expert once over the rows routed to it). The union is taken two ways:

- uniform: the expected number of distinct experts when each row picks k of E experts independently,
  E (1 - (1 - k/E)^N), as the synthetic files route;
- from a router trace (`--trace`, any format `moestream simulate` reads; the vLLM-MoE-Logger files of
  ../shared/traces/ are real decode batches of many requests at once): N rows drawn from one decode step
  of one layer (rows of different requests at the same moment; from one layer's decode rows at random
  where no step has N), their distinct experts counted, averaged over --samples draws. The trace's model
  need not be the file's: it is printed beside the uniform expectation for its own E and k, as the share
  of uniform's extra experts that real routing adds (1.0: real rows overlap no more than random ones).

Nothing is run on the model: the bytes are the file's tensors' sizes, by name (`blk.N.*_exps` routed
experts, `output.weight` the head, else the tied `token_embd.weight`; one embedding row a token).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf import GGUFReader

MiB = 1 << 20


def model_bytes(path: str) -> dict:
    """Per layer: the routed experts' bytes per expert and the trunk's bytes; the head's; E and k."""
    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        if field is None:
            raise SystemExit(f"{path}: no {arch}.{key} in its metadata (not a MoE file?)")
        return int(field.parts[-1][0])

    experts, top_k = meta("expert_count"), meta("expert_used_count")
    per_expert: dict[int, int] = defaultdict(int)
    trunk: dict[int, int] = defaultdict(int)
    head = embd = vocab = 0
    for t in reader.tensors:
        block = re.match(r"blk\.(\d+)\.", t.name)
        if block and "_exps" in t.name:
            per_expert[int(block.group(1))] += int(t.n_bytes) // experts
        elif block:
            trunk[int(block.group(1))] += int(t.n_bytes)
        elif t.name == "output.weight":
            head = int(t.n_bytes)
        elif t.name == "token_embd.weight":
            embd, vocab = int(t.n_bytes), int(t.shape[-1])
    return {
        "arch": arch,
        "experts": experts,
        "top_k": top_k,
        "layers": sorted(per_expert),
        "per_expert": dict(per_expert),
        "trunk": dict(trunk),
        "head": head or embd,  # tied: the embedding is the head
        "embd_row": embd // max(vocab, 1),
    }


def uniform_distinct(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts of `rows` rows each routed to `top_k` of `experts` independently."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def step_bytes(m: dict, rows: int, distinct: float) -> float:
    """Bytes a decode step of `rows` rows reads, each layer routing to `distinct` experts."""
    layers = sum(m["trunk"].get(i, 0) + distinct * m["per_expert"][i] for i in m["layers"])
    return layers + m["head"] + rows * m["embd_row"]


def trace_distinct(paths: list[str], rows_list: list[int], samples: int, seed: int) -> dict:
    """Mean distinct experts of N rows drawn from one decode step of one layer (see the module's text)."""
    import numpy as np

    from moestream.trace.reader import load_traces

    trace = load_traces(paths)
    decode = np.flatnonzero(trace.phase == 1)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    by_layer: dict[int, list[int]] = defaultdict(list)
    for i in decode.tolist():
        groups[(int(trace.step[i]), int(trace.layer[i]))].append(i)
        by_layer[int(trace.layer[i])].append(i)
    rng = random.Random(seed)
    out = {"experts": trace.header.n_experts, "top_k": trace.header.top_k, "rows": {}}
    for n in rows_list:
        pools = [g for g in groups.values() if len(g) >= n]
        where = "one decode step"
        if not pools:
            pools, where = [g for g in by_layer.values() if len(g) >= n], "one layer's decode rows"
        counts = []
        for _ in range(samples):
            pool = pools[rng.randrange(len(pools))]
            picked = rng.sample(pool, n)
            counts.append(len(set(trace.experts[picked].ravel().tolist())))
        out["rows"][n] = {"distinct": statistics.mean(counts), "from": where, "pools": len(pools)}
    out["decode_rows"] = len(decode)
    out["steps"] = len({int(s) for s in trace.step[decode]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="the GGUF file whose tensors' sizes count")
    p.add_argument("--rows", default="1,2,4,8", help="rows (concurrent sequences) a step, comma-separated")
    p.add_argument("--trace", nargs="+", default=None, help="router trace(s) for real routing's overlap")
    p.add_argument("--samples", type=int, default=4000, help="draws per row count from the trace")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows_list = sorted({int(r) for r in args.rows.split(",")})
    m = model_bytes(args.model)
    e, k = m["experts"], m["top_k"]
    experts_one = sum(k * m["per_expert"][i] for i in m["layers"])
    trunk = sum(m["trunk"].values())
    print(
        f"{Path(args.model).name}: {m['arch']}, {len(m['layers'])} layers, {e} experts, top-{k}; one token "
        f"reads {experts_one / MiB:.0f} MiB of routed experts, {trunk / MiB:.0f} MiB of trunk, "
        f"{m['head'] / MiB:.0f} MiB of head"
    )
    one = step_bytes(m, 1, k)
    print(
        "\nrows | distinct experts a layer (uniform) | MiB a step | x one row's | ceiling in RAM: N streams "
        "/ one | experts only: x one row's | ceiling streaming"
    )
    for n in rows_list:
        d = uniform_distinct(e, k, n)
        b = step_bytes(m, n, d)
        print(
            f"{n:4} | {d:35.2f} | {b / MiB:10.0f} | {b / one:11.2f} | {n * one / b:29.2f}x | "
            f"{d / k:25.2f} | {n * k / d:16.2f}x"
        )
    if args.trace:
        t = trace_distinct(args.trace, rows_list, args.samples, args.seed)
        te, tk = t["experts"], t["top_k"]
        print(
            f"\ntrace {', '.join(Path(x).name for x in args.trace)}: {te} experts, top-{tk}, "
            f"{t['decode_rows']} decode rows in {t['steps']} steps"
        )
        print("rows | distinct experts (trace) | uniform | share of uniform's extra | drawn from")
        for n in rows_list:
            r = t["rows"][n]
            u = uniform_distinct(te, tk, n)
            share = (r["distinct"] - tk) / (u - tk) if u > tk else float("nan")
            print(
                f"{n:4} | {r['distinct']:24.2f} | {u:7.2f} | {share:24.2f} | "
                f"{r['from']} ({r['pools']} of them)"
            )


if __name__ == "__main__":
    main()
