"""Recording router traces while generating: one row per (request, token, phase, MoE layer).

Optionally with the stale-gate prediction of the seed's mechanism 3: layer L+1's (and L+2's) router
applied to layer L's router input, top-2k experts with their softmax scores.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moestream.cache.slots import slot_bytes as slot_size
from moestream.model.loader import router_modules
from moestream.trace import TraceError, TraceHeader, TraceWriter


class TraceRecorder:
    """Receives every streamed layer's routing from the runtime and appends it to a trace file."""

    def __init__(self, engine: Any, path: str | Path, predict: bool = True, flush_rows: int = 4096) -> None:
        self.writer = TraceWriter(path, _header(engine), flush_rows=flush_rows)
        self.error: TraceError | None = None  # the write that failed; recording stopped there
        self.top_k = engine.top_k
        self.routers = router_modules(engine.model) if predict else {}
        self.request, self.phase, self.first_position, self.step = "", "prefill", 0, 0
        engine.runtime.observers.append(self.observe)

    def forward(self, request: str, phase: str, first_position: int) -> None:
        """Called before each model forward: which request, phase and token positions it covers."""
        self.request, self.phase, self.first_position = request, phase, first_position
        self.step += 1

    @torch.inference_mode()
    def observe(self, layer: int, hidden: torch.Tensor, rows: list[list[int]], weights: torch.Tensor) -> None:
        if self.error is not None:
            return  # a failed trace (a full disk) must not stop the generation; close() reports it
        try:
            self._append(layer, hidden, rows, weights)
        except TraceError as exc:
            self.error = exc

    def _append(self, layer: int, hidden: torch.Tensor, rows: list[list[int]], weights: torch.Tensor) -> None:
        tokens = range(self.first_position, self.first_position + len(rows))
        extra: dict[str, Any] = {}
        for ahead, prefix in ((1, "pred"), (2, "pred2")):
            router = self.routers.get(layer + ahead)
            if router is not None:
                experts, scores = self._predict(router, hidden)
                extra[f"{prefix}_experts"], extra[f"{prefix}_scores"] = experts, scores
        self.writer.append_forward(self.request, list(tokens), self.phase, layer, rows,
                                   weights.float().tolist(), step=self.step, **extra)

    def _predict(self, router: torch.nn.Module, hidden: torch.Tensor) -> tuple[list, list]:
        out = router(hidden)
        logits = out if isinstance(out, torch.Tensor) else out[0]  # routers return (logits, weights, indices)
        scores = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(scores, min(2 * self.top_k, scores.shape[-1]), dim=-1)
        return top.indices.tolist(), top.values.tolist()

    def flush(self) -> None:
        """Hand the rows recorded so far to the kernel (a failure is kept for close(), as in observe)."""
        if self.error is None:
            try:
                self.writer.flush()
            except TraceError as exc:
                self.error = exc

    def close(self) -> None:
        """Finish the file. Raises TraceError when recording failed (now or during the run)."""
        self.writer.close()


def _header(engine: Any) -> TraceHeader:
    emap, config = engine.emap, engine.config
    n_layers = int(getattr(config, "num_hidden_layers", None) or getattr(config.get_text_config(), "num_hidden_layers"))
    per_layer_unit, per_layer_slot = {}, {}
    for (layer, expert), parts in emap.units.items():
        per_layer_unit[layer] = max(per_layer_unit.get(layer, 0), emap.unit_bytes(layer, expert))
        per_layer_slot[layer] = max(per_layer_slot.get(layer, 0), slot_size(parts))
    first = min(per_layer_unit)
    dtype = "mxfp4" if emap.quant == "mxfp4" else str(engine.dtype).removeprefix("torch.")
    return TraceHeader(
        model_id=str(engine.path), n_layers=n_layers, n_experts=emap.num_experts, top_k=engine.top_k, dtype=dtype,
        # dense layers get the first MoE layer's size: the lists are indexed by layer and never read there
        expert_bytes=[per_layer_unit.get(i, per_layer_unit[first]) for i in range(n_layers)],
        slot_bytes=[per_layer_slot.get(i, per_layer_slot[first]) for i in range(n_layers)],
        synthetic=(Path(engine.path) / "moestream_synth.json").exists(), source="moestream recorder",
    )
