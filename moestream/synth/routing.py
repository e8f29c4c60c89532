"""How a model routes: expert-load concentration and token-to-token overlap, per MoE layer.

Two measures decide how flattering a cache figure is:

- `hot8_share`: the fraction of all expert picks in a layer that go to that layer's 8 most-picked
  experts. Uniform load gives 8/E (12.5% for 64 experts); a collapsed router gives nearly 100%.
- `adjacent_overlap`: the mean over consecutive token pairs of |experts(t) & experts(t+1)| / top_k.
  Independent random picks give top_k/E; real 2025-26 MoEs show roughly 0.27-0.39.

The picks are read from the router modules (`mlp.gate`, `mlp.router` for gpt-oss) with forward
hooks, so the measure works on the stock model and on one whose experts modules were replaced.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moestream.synth.sample_text import SAMPLE_TEXT

__all__ = ["SAMPLE_TEXT", "adjacent_overlap", "hot_share", "routing_measures", "routing_stats"]

# router modules of every supported family, e.g. "model.layers.3.mlp.gate", "model.layers.0.mlp.router"
_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)$")
HOT = 8


def hot_share(picks: torch.Tensor, hot: int = HOT) -> float:
    """Share of all picks ([T, K] expert indices) that go to the `hot` most-picked experts."""
    counts = torch.bincount(picks.reshape(-1).long())
    return float(counts.sort(descending=True).values[:hot].sum()) / picks.numel()


def adjacent_overlap(picks: torch.Tensor) -> float:
    """Mean over t of |experts(t) & experts(t+1)| / K for [T, K] picks (NaN with fewer than 2 tokens)."""
    if picks.shape[0] < 2:
        return float("nan")
    prev, nxt = picks[:-1], picks[1:]
    shared = (prev[:, :, None] == nxt[:, None, :]).any(dim=-1).sum(dim=-1)  # [T-1]
    return float(shared.float().mean()) / picks.shape[1]


def routing_measures(picks: Mapping[int, torch.Tensor], num_experts: int | None = None) -> dict[str, Any]:
    """Per-layer and mean `hot8_share` / `adjacent_overlap` of {layer: [T, K] expert indices}.

    With `num_experts`, the values of uniform independent routing are included for comparison.
    """
    layers = [
        {"layer": layer, "hot8_share": hot_share(p), "adjacent_overlap": adjacent_overlap(p)}
        for layer, p in sorted(picks.items())
    ]
    if not layers:
        raise ValueError("no router picks to measure")
    first = picks[layers[0]["layer"]]
    out: dict[str, Any] = {
        "tokens": int(first.shape[0]),
        "top_k": int(first.shape[1]),
        "layers": layers,
        "hot8_share": sum(r["hot8_share"] for r in layers) / len(layers),
        "adjacent_overlap": sum(r["adjacent_overlap"] for r in layers) / len(layers),
    }
    if num_experts:
        out["num_experts"] = num_experts
        out["uniform_hot8_share"] = min(1.0, HOT / num_experts)
        out["uniform_adjacent_overlap"] = out["top_k"] / num_experts
    return out


def routing_stats(
    model: Any,
    tokenizer: Any,
    text: str = SAMPLE_TEXT,
    *,
    top_k: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Run `model` once on `text` and measure its routing (see `routing_measures` for the result).

    Works with any transformers MoE whose routers return `(logits, weights, indices)` (5.x) or plain
    logits (then the top `top_k` logits are taken; default: the config's num_experts_per_tok).
    """
    routers = [(int(m.group(1)), mod) for name, mod in model.named_modules() if (m := _ROUTER.search(name))]
    if not routers:
        raise ValueError(
            f"no router modules (...layers.N.mlp.gate / .router) found in {type(model).__name__}"
        )
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    k = top_k or getattr(cfg, "num_experts_per_tok", None)
    picks: dict[int, torch.Tensor] = {}
    widths: set[int] = set()

    def capture(layer: int) -> Callable[[Any, Any, Any], None]:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            idx, logits = _indices(output, k)
            picks[layer] = idx.detach().reshape(-1, idx.shape[-1]).cpu()
            if logits is not None:
                widths.add(int(logits.shape[-1]))

        return hook

    handles = [mod.register_forward_hook(capture(layer)) for layer, mod in routers]
    try:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        if max_tokens:
            ids = ids[:, :max_tokens]
        with torch.no_grad():
            model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    num_experts = getattr(cfg, "num_experts", None) or (max(widths) if widths else None)
    return routing_measures(picks, num_experts)


def _indices(output: Any, k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(expert indices [.., K], router logits or None) from a router module's output."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    logits = next((t for t in tensors if t.is_floating_point()), None)
    ints = [t for t in tensors if not t.is_floating_point()]
    if ints:
        return ints[-1], logits
    if logits is None or not k:
        raise ValueError("router output has neither expert indices nor logits with a known top_k")
    return logits.topk(k, dim=-1).indices, logits


def format_stats(stats: dict[str, Any]) -> str:
    """Per-layer table and means, as printed by `python -m moestream.synth.routing`."""
    lines = [
        f"{stats['tokens']} tokens, top-{stats['top_k']} of {stats.get('num_experts', '?')} experts",
        "layer  hot8_share  adjacent_overlap",
    ]
    lines += [
        f"{r['layer']:5d}  {r['hot8_share']:10.3f}  {r['adjacent_overlap']:16.3f}" for r in stats["layers"]
    ]
    lines.append(f" mean  {stats['hot8_share']:10.3f}  {stats['adjacent_overlap']:16.3f}")
    if "uniform_hot8_share" in stats:
        lines.append(f"uniform {stats['uniform_hot8_share']:8.3f}  {stats['uniform_adjacent_overlap']:16.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m moestream.synth.routing CHECKPOINT`: load it with stock transformers (fp32), measure
    its routing on SAMPLE_TEXT and print the table."""
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    parser = argparse.ArgumentParser(prog="python -m moestream.synth.routing", description=main.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    # an MXFP4 checkpoint's experts dequantized by transformers: its kept-blocks path fetches a kernel
    # from the hub (transformers >= 5.25)
    quant = getattr(AutoConfig.from_pretrained(args.checkpoint), "quantization_config", None)
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quant else {}
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, **extra)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    print(format_stats(routing_stats(model, tokenizer, SAMPLE_TEXT, max_tokens=args.max_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
