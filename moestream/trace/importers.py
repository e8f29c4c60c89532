"""Importers for router logs recorded by others (see ../shared/traces/README.md).

Both formats lack what a replay needs (phases, forward boundaries, expert sizes), so each importer
reconstructs it from the row order and records every assumption in the header's `notes`.

- speculative-moe JSONL (Mixtral-8x7B): `{dataset, problem_id, layer, token_pos, experts, gating_probs}`.
  The real file lists the prompt layer by layer (every token of layer 0, then of layer 1, ...), then the
  generated tokens token by token with token_pos always 0, and some (token, layer) rows are missing.
- vLLM-MoE-Logger JSONL: a `meta` line, then `{type: route, req_id, token_idx, layer, topk_ids,
  topk_weights}` where token_idx is the row's position in its forward batch (it restarts at 0 each
  forward). Each file holds one layer; several files of one workload are merged into one model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestream.trace.errors import TraceError
from moestream.trace.schema import TraceHeader
from moestream.trace.table import Trace, trace_from_pylists

SPECULATIVE_MOE = "speculative-moe JSONL"
VLLM_LOGGER = "vLLM-MoE-Logger JSONL"


def _columns() -> dict[str, list[Any]]:
    return {name: [] for name in ("request", "token", "phase", "layer", "step", "experts", "weights")}


def _header(
    model_id: str,
    rows: list[list[int]],
    layers: list[int],
    source: str,
    notes: list[str],
    token_order_known: bool = True,
) -> TraceHeader:
    top_k = len(rows[0])
    n_experts = max(max(r) for r in rows) + 1
    notes.append(
        f"n_layers {max(layers) + 1} and n_experts {n_experts} are the largest ids seen + 1; "
        f"top_k {top_k} is the row width; the file gives no expert sizes or dtype (pass --unit-bytes)"
    )
    return TraceHeader(
        model_id=model_id,
        n_layers=max(layers) + 1,
        n_experts=n_experts,
        top_k=top_k,
        source=source,
        notes=notes,
        token_order_known=token_order_known,
    )


# --- speculative-moe (Mixtral) -------------------------------------------------------------------------


def import_speculative_moe(path: Path, records: list[dict[str, Any]]) -> Trace:
    """Rows of one speculative-moe routing file, one request per (dataset, problem_id)."""
    by_request: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_request.setdefault(f"{rec.get('dataset', 'request')}/{rec.get('problem_id', 0)}", []).append(rec)
    cols, step = _columns(), 0
    stats = Counter()
    for name, recs in by_request.items():
        step = _add_request(cols, stats, name, recs, step)
    notes = [
        f"{path.name}: {SPECULATIVE_MOE}; {len(by_request)} request(s), one per (dataset, problem_id)",
        f"the leading layer-by-layer block of each request is its prefill ({stats['prefill_tokens']} tokens, "
        f"{stats['prefill_rows']} rows, one forward per layer); the rest is decode",
        f"decode tokens are numbered after the prompt in file order, a new token starting wherever the layer "
        f"number does not increase ({stats['decode_tokens']} tokens)" + _pos_note(stats),
        f"{stats['missing_prefill']} prefill and {stats['missing_decode']} decode (token, layer) rows are "
        "absent "
        "from the file; the replay treats those as not routed (no expert access)",
    ]
    header = _header(
        "unknown (speculative-moe routing log)",
        cols["experts"],
        cols["layer"],
        f"{path.name} ({SPECULATIVE_MOE})",
        notes,
    )
    return trace_from_pylists(header, cols)


def _pos_note(stats: Counter) -> str:
    if not stats["bad_pos"]:
        return ""
    if stats["zero_pos"] == stats["bad_pos"]:
        return f"; their token_pos is 0 on all {stats['bad_pos']} rows that disagree, so it was ignored"
    return f"; the token_pos of {stats['bad_pos']} decode rows disagrees with that numbering and was ignored"


def _prefill_length(recs: list[dict[str, Any]]) -> int:
    """How many leading rows form layer-major prefill blocks (token_pos rising within a block)."""
    prev = None
    for i, rec in enumerate(recs):
        layer, pos = rec["layer"], rec["token_pos"]
        if prev is not None:
            same_block = layer == prev[0] and pos > prev[1]
            next_block = layer > prev[0] and pos <= prev[1]
            if not (same_block or next_block):
                return i
        prev = (layer, pos)
    return len(recs)


def _add_request(
    cols: dict[str, list[Any]], stats: Counter, name: str, recs: list[dict[str, Any]], step: int
) -> int:
    """Append one request's rows; returns the next free step number."""
    n_prefill = _prefill_length(recs)
    layers = sorted({rec["layer"] for rec in recs})
    prompt = max(rec["token_pos"] for rec in recs[:n_prefill]) + 1
    stats["prefill_tokens"] += prompt
    stats["prefill_rows"] += n_prefill
    stats["missing_prefill"] += prompt * len(layers) - n_prefill
    token, prev = prompt - 1, None
    for i, rec in enumerate(recs):
        if i < n_prefill:
            phase, tok, row_step = "prefill", rec["token_pos"], step
        else:
            if prev is None or rec["layer"] <= prev["layer"] or rec["token_pos"] != prev["token_pos"]:
                token += 1
                stats["decode_tokens"] += 1
            phase, tok, row_step, prev = "decode", token, step + 1 + token - prompt, rec
            stats["bad_pos"] += rec["token_pos"] != tok
            stats["zero_pos"] += rec["token_pos"] != tok and rec["token_pos"] == 0
        for key, value in (
            ("request", name),
            ("token", tok),
            ("phase", phase),
            ("layer", rec["layer"]),
            ("step", row_step),
            ("experts", rec["experts"]),
            ("weights", rec["gating_probs"]),
        ):
            cols[key].append(value)
    n_decode = token - prompt + 1
    stats["missing_decode"] += n_decode * len(layers) - (len(recs) - n_prefill)
    return step + 1 + n_decode


# --- vLLM-MoE-Logger (Qwen1.5-MoE) -----------------------------------------------------------------------


def _batches(routes: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Forward batches of one layer: token_idx counts 0, 1, 2, ... within a forward and restarts after."""
    out: list[list[dict[str, Any]]] = []
    for rec in routes:
        if not out or rec["token_idx"] != out[-1][-1]["token_idx"] + 1:
            out.append([])
        out[-1].append(rec)
    return out


def import_vllm_logger(logs: Sequence[tuple[Path, dict[str, Any], list[dict[str, Any]]]]) -> Trace:
    """Merge vLLM-MoE-Logger files (path, meta line, route records) into one trace, layer by layer.

    Every layer must show the same sequence of forward sizes; otherwise the files are not one workload.
    """
    per_layer: dict[int, list[list[dict[str, Any]]]] = {}
    origin: dict[int, Path] = {}
    for path, _, routes in logs:
        for layer in sorted({rec["layer"] for rec in routes}):
            if layer in per_layer:
                raise TraceError(f"{path} repeats layer {layer}, already read from {origin[layer]}")
            per_layer[layer], origin[layer] = _batches([r for r in routes if r["layer"] == layer]), path
    layers = sorted(per_layer)
    sizes = [len(b) for b in per_layer[layers[0]]]
    for layer in layers[1:]:
        if [len(b) for b in per_layer[layer]] != sizes:
            raise TraceError(
                f"{origin[layer]} (layer {layer}) and {origin[layers[0]]} (layer {layers[0]}) "
                "have different forward batches, so they cannot be replayed as one model"
            )
    dummy = [
        all(len({tuple(r["topk_ids"]) for r in per_layer[lay][b]}) == 1 for lay in layers) and sizes[b] > 1
        for b in range(len(sizes))
    ]
    kept = [b for b in range(len(sizes)) if not dummy[b]]
    if not kept:
        raise TraceError(f"{origin[layers[0]]} holds only forwards whose rows all route alike (dummy runs)")
    decode_width = Counter(sizes[b] for b in kept).most_common(1)[0][0]
    cols, token = _columns(), 0
    for step, b in enumerate(kept):
        phase = "prefill" if sizes[b] > decode_width else "decode"
        for layer in layers:
            for pos, rec in enumerate(per_layer[layer][b]):
                for key, value in (
                    ("request", str(rec.get("req_id", "r0"))),
                    ("token", token + pos),
                    ("phase", phase),
                    ("layer", layer),
                    ("step", step),
                    ("experts", rec["topk_ids"]),
                    ("weights", rec["topk_weights"]),
                ):
                    cols[key].append(value)
        token += sizes[b]
    notes = _vllm_notes(logs, layers, sizes, dummy, kept, decode_width)
    model = str(logs[0][1].get("model_id", "unknown"))
    header = _header(
        model,
        cols["experts"],
        cols["layer"],
        ", ".join(p.name for p, _, _ in logs) + f" ({VLLM_LOGGER})",
        notes,
        token_order_known=False,
    )
    return trace_from_pylists(header, cols)


def _vllm_notes(
    logs: Sequence[tuple[Path, dict[str, Any], list[dict[str, Any]]]],
    layers: list[int],
    sizes: list[int],
    dummy: list[bool],
    kept: list[int],
    decode_width: int,
) -> list[str]:
    dropped = [sizes[b] for b in range(len(sizes)) if dummy[b]]
    prefill = [sizes[b] for b in kept if sizes[b] > decode_width]
    notes = [
        f"{len(logs)} {VLLM_LOGGER} file(s), layers {layers}: each forward batch (token_idx restarting at 0) "
        "is replayed as one forward over the union of its rows' experts",
        f"dropped {len(dropped)} forward(s) of {dropped} rows whose rows all route identically "
        "(vLLM's profiling and warm-up dummy runs)"
        if dropped
        else "no dummy forwards found",
        f"forwards larger than {decode_width} rows (the most common size, taken as the decode batch) are "
        f"prefill: {len(prefill)} forward(s) of {prefill} tokens; {len(kept) - len(prefill)} decode steps",
        "rows cannot be tied to their request (the log has one req_id), so token order within a request "
        "is unknown and static pinning splits by forward steps",
    ]
    if len(logs) > 1:
        notes.append(
            "the files come from separate runs of one workload; their forward sizes match, so they "
            f"are replayed as one {len(layers)}-layer model (layers absent from the files are skipped)"
        )
    return notes
