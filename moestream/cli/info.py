"""`moestream info PATH`: architecture, expert bytes, working set, minimum cache, and how it routes."""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

from moestream.cli._engine_args import add_model_argument, model_path
from moestream.units import MiB, format_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info", help="describe a checkpoint: expert bytes, working set, minimum cache, routing"
    )
    add_model_argument(p)
    p.add_argument(
        "--no-routing",
        action="store_true",
        help="skip running the model on the sample text (which reads every expert once)",
    )
    p.add_argument("--cache", default=None, help="cache budget for the routing run (default 512MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def describe(path: str) -> dict[str, Any]:
    """Everything `info` reports that needs only the checkpoint's config and tensor headers."""
    from moestream.cache.size_classes import budget_requirements
    from moestream.cache.slots import slot_bytes
    from moestream.model.arch import arch_for, num_experts, top_k
    from moestream.runtime.checks import check_experts
    from moestream.store.source import open_source

    source = open_source(path)
    config = source.config()
    arch = arch_for(config)
    emap = source.expert_map(arch.family, num_experts(config))
    check_experts(emap, config)  # sizes printed from a malformed expert would be wrong too
    k = top_k(config)
    minimum, working_set = budget_requirements(emap, k)
    largest = max(emap.units, key=lambda key: emap.unit_bytes(*key))
    sizes = [emap.unit_bytes(*key) for key in emap.units]
    per_layer = {layer: 0 for layer in emap.layers}
    for (layer, _), size in zip(emap.units, sizes):
        per_layer[layer] += size
    total_bytes = sum(ref.nbytes for ref in source.tensors.values())
    return {
        "path": str(source.path),
        "model_type": config.model_type,
        "family": arch.family,
        "formats": emap.format_names(),
        "formats_by_kind": formats_by_kind(emap),
        "moe_layers": len(emap.layers),
        "experts_per_layer": emap.num_experts,
        "top_k": k,
        "expert_bytes": emap.unit_bytes(*largest),
        "expert_bytes_min": min(sizes),
        "expert_slot_bytes": slot_bytes(emap.units[largest]),
        "expert_bytes_per_layer": max(per_layer.values()),
        "all_expert_bytes": emap.expert_bytes,
        "checkpoint_bytes": total_bytes,
        "non_expert_bytes": total_bytes - emap.expert_bytes - sum(r.nbytes for r in emap.resident.values()),
        "working_set_bytes": working_set,
        "minimum_cache_bytes": minimum,
        "synthetic": source.synthetic,
    }


def formats_by_kind(emap: Any) -> dict[str, dict[str, int]]:
    """kind -> stored format -> number of MoE layers storing that kind in it (a Q4_K_M GGUF keeps some
    layers' down at Q6_K)."""
    out: dict[str, dict[str, int]] = {kind: {} for kind in emap.kinds}
    for (_, kind), stored in sorted(emap.formats.items()):
        out[kind][stored.name] = out[kind].get(stored.name, 0) + 1
    return out


def routing(path: str, cache: str) -> dict[str, Any]:
    """Routing measures of the streamed model on the built-in sample text."""
    import moestream
    from moestream.synth.routing import SAMPLE_TEXT, routing_stats

    # transformers' forward over the whole text (the ggml graphs compute a step's last position only)
    with moestream.load(path, cache=cache, trunk="eager") as engine:
        return routing_stats(engine.model, engine.tokenizer, SAMPLE_TEXT)


def run(args: argparse.Namespace) -> int:
    if args.no_routing and args.cache is not None:
        warnings.warn("--cache sizes the routing run, which --no-routing skips", stacklevel=2)
    path = model_path(args)
    info = describe(path)
    if not args.no_routing:
        info["routing"] = routing(path, args.cache or "512MiB")
    if args.json:
        print(json.dumps(info))
        return 0
    _print(info)
    return 0


def _print(info: dict[str, Any]) -> None:
    print(
        f"{info['path']}: {info['model_type']} ({info['family']} experts, stored as "
        f"{', '.join(info['formats'])}){'  [synthetic]' if info['synthetic'] else ''}"
    )
    print(f"  MoE layers {info['moe_layers']} x {info['experts_per_layer']} experts, top-{info['top_k']}")
    stored = "; ".join(
        f"{kind} " + ", ".join(f"{name} ({n} layers)" for name, n in by_format.items())
        for kind, by_format in info["formats_by_kind"].items()
    )
    print(f"  stored as: {stored}")
    smallest, largest = info["expert_bytes_min"], info["expert_bytes"]
    low = f"{smallest / MiB:.2f}.." if smallest != largest else ""
    print(
        f"  one expert {low}{info['expert_bytes'] / MiB:.2f} MiB on disk "
        f"({format_size(info['expert_slot_bytes'])} slot); "
        f"per layer {format_size(info['expert_bytes_per_layer'])} (largest); all experts "
        f"{format_size(info['all_expert_bytes'])}"
    )
    print(f"  resident (non-expert) weights {format_size(info['non_expert_bytes'])}")
    print(f"  per-token working set {format_size(info['working_set_bytes'])} (top-k x every MoE layer)")
    print(f"  minimum cache {format_size(info['minimum_cache_bytes'])} ({info['minimum_cache_bytes']} bytes)")
    if "routing" in info:
        r = info["routing"]
        print(
            f"  routing on the sample text ({r['tokens']} tokens): hottest 8 experts take "
            f"{100 * r['hot8_share']:.1f}% of picks (mean over layers), adjacent tokens share "
            f"{100 * r['adjacent_overlap']:.1f}% of their experts"
        )
        for row in r["layers"]:
            print(
                f"    layer {row['layer']:3d}: hot-8 {100 * row['hot8_share']:5.1f}%  "
                f"adjacent {100 * row['adjacent_overlap']:5.1f}%"
            )
