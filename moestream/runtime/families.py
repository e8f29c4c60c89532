"""Expert families: the order of an expert's compute stages and the math between them.

A family writes its math once, over a batch of E experts (mlx-lm's SwitchGLU): a stage is the tuple of
kinds it needs; it computes from the rows x [t, H] (every expert of the batch sees the same rows) and
the previous stage's value (`carry` [E, t, .]). `linear(kind, x)` multiplies x ([t, in], or [E, t, in]:
expert i's own rows) by each expert's weight of that kind in whatever format and tier it lives ->
[E, t, out] (the format's one batched linear). The runtime runs the same stages for one expert as its
bytes land (E = 1) and for a layer's held experts at once (runtime/switch.py). `fusions` names kinds
that a tier may lay out back to back and compute as one matrix (gate and up: [2I, H], gate rows first,
the matmul transformers runs). This module is the only place that looks at family names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.activations import ACT2FN

from moestream.errors import UnsupportedModelError
from moestream.hfconfig import text_config
from moestream.store.experts import ExpertMap
from moestream.store.tensors import read_tensor

Linear = Callable[[str, torch.Tensor], torch.Tensor]  # (kind, x [t, in] | [E, t, in]) -> [E, t, out]
Experts = Sequence[int] | torch.Tensor  # the batch's expert ids (a device tensor: runtime/resident.py)


@dataclass(frozen=True)
class GraphTerms:
    """What a ggml graph adds to gate/up/down products (by ggml_mul_mat_id) to compute a layer's experts
    as the family does: nothing (a SiLU SwiGLU), or gpt-oss's biases and clamped SwiGLU."""

    biases: dict[str, torch.Tensor] | None = None  # "gate" | "up" | "down" -> f32 [E, out], by expert id
    oai: tuple[float, float] | None = None  # (alpha, limit) of ggml_swiglu_oai, else ggml_swiglu_split
    # gate and up are the two halves of the rows of one kind, gate_up (gate rows first), not kinds
    halves: bool = False


class ExpertFamily(ABC):
    kinds: tuple[str, ...]
    fusions: ClassVar[dict[str, tuple[str, ...]]] = {}
    # device types where a layer's held experts may be computed as one batch (every stage on all of
    # them): where the batched stages were checked against one expert at a time, bit for bit
    batched_on: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def graph_terms(self, layer: int) -> GraphTerms | None:
        """How the ggml graphs compute `layer`'s experts with the bits the stages give under the graphs'
        kernels, or None: they cannot (the expert runtime computes them always)."""
        return None

    def stages(self, fused: bool) -> list[tuple[str, ...]]:
        """The kinds each stage needs, in execution order; `fused`: the tier computes `fusions` as one."""
        return [(kind,) for kind in self.kinds]

    def row_order(self, layer: int, kind: str) -> torch.Tensor | None:
        """The stored row of each row of `kind` [R] as a format that rewrites its bytes once read (`repacks`)
        is to lay them out for this family's stages, or None: as stored."""
        return None

    @staticmethod
    @abstractmethod
    def logical_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
        """kind -> the [out, in] matrix its stage multiplies by, for hidden size H and expert size I."""

    @staticmethod
    def resident_shapes(hidden: int, inter: int, experts: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the per-layer tensors kept resident beside the streamed experts."""
        return {}

    def bind(self, formats: dict[tuple[int, str], Any]) -> None:
        """The runtime's formats for (layer, kind), given once it has chosen them."""

    @abstractmethod
    def stage(
        self,
        kinds: tuple[str, ...],
        x: torch.Tensor,
        carry: torch.Tensor | None,
        linear: Linear,
        layer: int,
        experts: Experts,
    ) -> torch.Tensor:
        """Run the stage of `stages(...)` that needs `kinds` for the batch `experts` (x [t, H], carry
        [E, t, .]); the last returns each expert's output [E, t, H]. Elementwise between the products,
        so each expert's rows get the same bits in any batch."""


class SwiGLU(ExpertFamily):
    """down(act(gate(x)) * up(x)): Qwen, Mixtral, OLMoE, DeepSeek, GLM. Stages gate -> up -> down (the
    order the seed found fastest to read in), or gate+up -> down when the tier fuses them."""

    kinds = ("gate", "up", "down")
    fusions: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up": ("gate", "up")}

    def __init__(self, act_fn: Callable[[torch.Tensor], torch.Tensor], act_name: str = "") -> None:
        self.act_fn, self.act_name = act_fn, act_name
        self._formats: dict[tuple[int, str], Any] = {}

    def bind(self, formats: dict[tuple[int, str], Any]) -> None:
        self._formats = formats if self.act_name == "silu" else {}  # the formats' kernels: silu only

    def graph_terms(self, layer: int) -> GraphTerms | None:
        return GraphTerms() if self.act_name == "silu" else None

    def _glu(self, layer: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        fmt = self._formats.get((layer, "up"))
        out = fmt.glu(gate, up) if fmt is not None else None
        return self.act_fn(gate) * up if out is None else out

    def stages(self, fused: bool) -> list[tuple[str, ...]]:
        return [("gate", "up"), ("down",)] if fused else [("gate",), ("up",), ("down",)]

    @staticmethod
    def logical_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
        return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}

    def stage(
        self,
        kinds: tuple[str, ...],
        x: torch.Tensor,
        carry: torch.Tensor | None,
        linear: Linear,
        layer: int,
        experts: Experts,
    ) -> torch.Tensor:
        if kinds == ("gate", "up"):  # gate_up [2I,H], gate rows first: one matmul, like transformers
            gate, up = linear("gate_up", x).chunk(2, dim=-1)
            return self.act_fn(gate) * up
        if kinds == ("gate",):  # gate [I,H]: [t,H] -> [E,t,I]
            return linear("gate", x)
        if kinds == ("up",):  # up [I,H]: act(gate) * up (by the format's kernels when it has one)
            return self._glu(layer, carry, linear("up", x))
        return linear("down", carry)  # down [H,I]: [E,t,I] -> [E,t,H]


@dataclass(frozen=True)
class GptOssParams:
    alpha: float
    limit: float


class GptOss(ExpertFamily):
    """gpt-oss: gate_up [H,2I] with gate/up interleaved by column and a bias, a clamped SwiGLU, then
    down [I,H] with a bias. The biases are small and stay resident on the compute device."""

    kinds = ("gate_up", "down")
    # its batched stages have not run on a GPU yet: there a layer's experts go one at a time, as before
    batched_on: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self, params: GptOssParams, biases: dict[tuple[int, str], torch.Tensor]) -> None:
        self.params, self.biases = params, biases
        self._formats: dict[tuple[int, str], Any] = {}
        self._gate_first: set[int] = set()  # layers whose gate_up rows are laid out gate rows first

    def bind(self, formats: dict[tuple[int, str], Any]) -> None:
        self._formats = formats
        # a format that rewrites gate_up once read (ggml's MXFP4 blocks) takes `row_order`'s rows
        self._gate_first = {layer for (layer, kind), f in formats.items() if kind == "gate_up" and f.repacks}

    def row_order(self, layer: int, kind: str) -> torch.Tensor | None:
        """gate_up's rows interleave gate (even) and up (odd): laid out gate rows first, as two [I, H]
        matrices the graphs address apart (each of its rows gives the same bits as in the whole)."""
        if kind != "gate_up":
            return None
        rows = self._formats[(layer, kind)].rows  # a repacking format's logical [out, in]
        return torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))

    def graph_terms(self, layer: int) -> GraphTerms | None:
        """Where gate_up is laid out gate rows first (`row_order`): the stages under the graphs' kernels,
        the biases de-interleaved alike."""
        if layer not in self._gate_first:
            return None
        gate_up = self.biases[(layer, "gate_up_proj_bias")].float()
        biases = {
            "gate": gate_up[:, ::2].contiguous(),
            "up": gate_up[:, 1::2].contiguous(),
            "down": self.biases[(layer, "down_proj_bias")].float().contiguous(),
        }
        return GraphTerms(biases, (self.params.alpha, self.params.limit), halves=True)

    @staticmethod
    def logical_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
        # gate_up fused (HF checkpoints), or gate and up apart (GGUF: `GptOssSplit`)
        return {
            "gate_up": (2 * inter, hidden),
            "gate": (inter, hidden),
            "up": (inter, hidden),
            "down": (hidden, inter),
        }

    @staticmethod
    def resident_shapes(hidden: int, inter: int, experts: int) -> dict[str, tuple[int, ...]]:
        fused = {"gate_up_proj_bias": (experts, 2 * inter), "down_proj_bias": (experts, hidden)}
        return {
            **fused,
            "gate_bias": (experts, inter),
            "up_bias": (experts, inter),
            "down_bias": (experts, hidden),
        }

    def glu(self, gate: torch.Tensor, up: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """(clamp(up) + 1) * swish_alpha(clamp(gate)), as transformers' GptOssExperts._apply_gate; under
        the ggml graphs' kernels (`by_id`), by ggml's op, the one the graphs compute it with."""
        fmt = self._formats.get((layer, "up"), self._formats.get((layer, "gate_up")))
        if getattr(fmt, "by_id", False):
            out = fmt.glu_oai(gate, up, self.params.alpha, self.params.limit)
            if out is not None:
                return out
        gate = gate.clamp(max=self.params.limit)
        up = up.clamp(min=-self.params.limit, max=self.params.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.params.alpha))

    def bias(self, layer: int, name: str, experts: Experts) -> torch.Tensor:
        """The batch's biases of `name`: [E, 1, out], added to each expert's rows [E, t, out]."""
        return self.biases[(layer, name)][experts].unsqueeze(-2)

    def stage(
        self,
        kinds: tuple[str, ...],
        x: torch.Tensor,
        carry: torch.Tensor | None,
        linear: Linear,
        layer: int,
        experts: Experts,
    ) -> torch.Tensor:
        if kinds == ("gate_up",) and layer in self._gate_first:  # [t,H] -> [E,t,2I]: gate, then up columns
            gate, up = linear("gate_up", x).chunk(2, dim=-1)
            bias = self.bias(layer, "gate_up_proj_bias", experts)
            return self.glu(gate + bias[..., ::2], up + bias[..., 1::2], layer)
        if kinds == ("gate_up",):  # [t,H] @ [H,2I]
            gate_up = linear("gate_up", x) + self.bias(layer, "gate_up_proj_bias", experts)
            return self.glu(gate_up[..., ::2], gate_up[..., 1::2])
        return linear("down", carry) + self.bias(layer, "down_proj_bias", experts)  # [E,t,I] @ [I,H]


class GptOssSplit(GptOss):
    """gpt-oss as GGUF stores it: gate [I,H], up [I,H] and down [H,I], each [out, in] with its own bias
    [E, out] (llama.cpp's converter de-interleaves gate_up's columns). The same math as `GptOss`;
    stages gate -> up -> down, or gate+up -> down when the tier fuses them ([2I,H], gate rows first)."""

    kinds = ("gate", "up", "down")
    fusions: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up": ("gate", "up")}

    def stages(self, fused: bool) -> list[tuple[str, ...]]:
        return [("gate", "up"), ("down",)] if fused else [("gate",), ("up",), ("down",)]

    def graph_terms(self, layer: int) -> GraphTerms | None:
        """The stages under the graphs' kernels: product + bias (an f32 add, as ggml_add_id adds), ggml's
        swiglu_oai, product + bias: the same ops in a graph give the same bits."""
        biases = {kind: self.biases[(layer, f"{kind}_bias")].float().contiguous() for kind in self.kinds}
        return GraphTerms(biases, (self.params.alpha, self.params.limit))

    def stage(
        self,
        kinds: tuple[str, ...],
        x: torch.Tensor,
        carry: torch.Tensor | None,
        linear: Linear,
        layer: int,
        experts: Experts,
    ) -> torch.Tensor:
        if kinds == ("gate", "up"):  # [t,H] -> [E,t,2I]: gate columns, then up columns
            gate, up = linear("gate_up", x).chunk(2, dim=-1)
            gate = gate + self.bias(layer, "gate_bias", experts)
            up = up + self.bias(layer, "up_bias", experts)
            return self.glu(gate, up, layer)
        if kinds == ("gate",):  # [t,H] -> [E,t,I], carried to the up stage
            return linear("gate", x) + self.bias(layer, "gate_bias", experts)
        if kinds == ("up",):
            return self.glu(carry, linear("up", x) + self.bias(layer, "up_bias", experts), layer)
        return linear("down", carry) + self.bias(layer, "down_bias", experts)  # [E,t,I] -> [E,t,H]


def _swiglu(config: Any, emap: ExpertMap, device: torch.device, dtype: torch.dtype) -> SwiGLU:
    act = text_config(config).hidden_act
    return SwiGLU(ACT2FN[act], act if isinstance(act, str) else "")


def _gpt_oss(config: Any, emap: ExpertMap, device: torch.device, dtype: torch.dtype) -> GptOss:
    """`GptOss` for HF's fused gate_up, `GptOssSplit` for separate gate and up (GGUF)."""
    cfg = text_config(config)
    biases = {key: read_tensor(ref).to(dtype).to(device) for key, ref in emap.resident.items()}
    # transformers < 5.2x hard-codes these two constants of gpt-oss's clamped SwiGLU
    params = GptOssParams(
        alpha=float(getattr(cfg, "swiglu_alpha", 1.702)), limit=float(getattr(cfg, "swiglu_limit", 7.0))
    )
    return (GptOssSplit if emap.kinds == GptOssSplit.kinds else GptOss)(params, biases)


_FAMILIES: dict[str, Callable[[Any, ExpertMap, torch.device, torch.dtype], ExpertFamily]] = {
    "swiglu": _swiglu,
    "gpt_oss": _gpt_oss,
}


FAMILY_CLASSES: dict[str, type[ExpertFamily]] = {"swiglu": SwiGLU, "gpt_oss": GptOss}


def make_family(config: Any, emap: ExpertMap, device: torch.device, dtype: torch.dtype) -> ExpertFamily:
    """The family object computing `emap`'s experts on `device` in `dtype`.

    Raises:
        UnsupportedModelError: the family's kinds are not the ones the expert map stores.
    """
    family = _FAMILIES[emap.family](config, emap, device, dtype)
    if family.kinds != emap.kinds:  # a runtime would wait forever for a kind that is never read
        raise UnsupportedModelError(
            f"{emap.family} experts stored as {', '.join(emap.kinds)} cannot be computed as "
            f"{', '.join(family.kinds)}"
        )
    return family
