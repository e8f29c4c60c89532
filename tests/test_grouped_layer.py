"""A one-token layer of cached experts in one grouped launch per matrix kind (the GPU's batch).

A `SwitchLayer` of the SwiGLU family over the GGUF GPU format (`GgufCuda.linear_experts`: one
`kernels.grouped_matmul` over the buffer the experts' views share) must give each expert exactly the
bits its stages give one by one through `linear`: the same kernel and tile for the same rows, and the
same elementwise torch ops between the matrices. Checked with gate and up fused (GPU slots) and apart
(unified memory), in a Q4_K_M-like mix (gate/up Q4_K, down Q6_K), with x in bf16 and fp32. Views that
do not share one buffer are computed one `linear` each (no grouped launch; the same bits).

Runs on a CUDA GPU when there is one, else in Triton's interpreter on the CPU (conftest sets
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (conftest sets it)", allow_module_level=True)

from gguf_blocks import random_blocks  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

from moestream import kernels  # noqa: E402
from moestream.runtime.families import SwiGLU  # noqa: E402
from moestream.runtime.formats import make_format  # noqa: E402
from moestream.runtime.switch import SwitchLayer  # noqa: E402
from moestream.store.experts import StoredFormat  # noqa: E402
from moestream.store.safetensors_file import TensorRef  # noqa: E402

H, I, EXPERTS = 256, 256, 3
TYPES = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def _formats(fused: bool):
    formats = {}
    for kind, name in TYPES.items():
        blocks = random_blocks(name, *SHAPES[kind])
        ref = TensorRef("unused", 0, blocks.size, name, SHAPES[kind], kind)
        formats[(0, kind)] = make_format(StoredFormat(name), [ref], "cuda")
    if fused:
        formats[(0, "gate_up")] = formats[(0, "gate")].fused(formats[(0, "up")])
    return formats


def _slots():
    """EXPERTS slots in one buffer as GpuSlotTier lays them out: gate then up with no gap (one gate_up
    matrix), down at the next 256-byte boundary; slots in a shuffled order, 17 bytes in."""
    parts = {
        e: {
            kind: torch.from_numpy(random_blocks(name, *SHAPES[kind], seed=10 * e + i)).reshape(-1)
            for i, (kind, name) in enumerate(TYPES.items())
        }
        for e in range(EXPERTS)
    }
    gate_up = parts[0]["gate"].numel() + parts[0]["up"].numel()
    down_at = (gate_up + 255) // 256 * 256
    slot_bytes = (down_at + parts[0]["down"].numel() + 255) // 256 * 256
    buffer = torch.zeros(17 + EXPERTS * slot_bytes, dtype=torch.uint8)
    where = {}
    for e, slot in zip(range(EXPERTS), (2, 0, 1)):
        base = 17 + slot * slot_bytes
        at = {"gate": base, "up": base + parts[e]["gate"].numel(), "down": base + down_at}
        for kind, start in at.items():
            buffer[start : start + parts[e][kind].numel()] = parts[e][kind]
        where[e] = at | {"gate_up": base}
    buffer = buffer.to(DEVICE)
    size = {kind: parts[0][kind].numel() for kind in TYPES} | {"gate_up": gate_up}

    def view(e, kind):
        return buffer[where[e][kind] : where[e][kind] + size[kind]]

    return view


def _stages(family, formats, x, view, fused):
    """Each expert through the family's stages one by one, by its format's `linear`, as the runtime
    runs them while bytes land."""

    def run(e):
        def linear(kind, rows):
            return formats[(0, kind)].linear(rows if rows.dim() == 2 else rows[0], view(e, kind))[None]

        carry = None
        for kinds in family.stages(fused):
            carry = family.stage(kinds, x, carry, linear, 0, [e])
        return carry[0]

    return torch.stack([run(e) for e in range(EXPERTS)])


def _plan(formats, fused, family):
    by_kind = {kind: fmt for (_, kind), fmt in formats.items()}
    return SwitchLayer.choose(0, family, by_kind, family.stages(fused), DEVICE, under_graphs=False)


def _launches(monkeypatch):
    launches = []
    grouped = kernels.grouped_matmul

    def counted(*args, **kwargs):
        launches.append(args[2])  # the type
        return grouped(*args, **kwargs)

    monkeypatch.setattr(kernels, "grouped_matmul", counted)
    return launches


@pytest.mark.parametrize(("fused", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_a_batch_equals_the_stages_bit_for_bit(fused, dtype, monkeypatch):
    formats = _formats(fused)
    family = SwiGLU(ACT2FN["silu"], "silu")
    family.bind(formats)
    view = _slots()
    x = (torch.randn(1, H, generator=torch.Generator().manual_seed(5)) * 0.5).to(dtype).to(DEVICE)
    asked = []

    def views(kind):
        asked.append(kind)
        return [view(e, kind) for e in range(EXPERTS)]

    plan = _plan(formats, fused, family)
    assert plan.batched and plan.at_once(1, EXPERTS) and not plan.at_once(2, EXPERTS)
    launches = _launches(monkeypatch)
    got = plan.experts(x, views, list(range(EXPERTS)))
    assert got.shape == (EXPERTS, 1, H) and got.dtype == dtype
    assert asked == (["gate_up", "down"] if fused else ["gate", "up", "down"])  # one launch per kind
    assert len(launches) == len(asked)
    want = _stages(family, formats, x, view, fused)
    assert torch.equal(got, want)
    assert got.abs().max() > 0 and not torch.equal(got[0], got[1])  # real products, per expert


def test_views_in_different_buffers_go_one_linear_each(monkeypatch):
    formats = _formats(fused=True)
    family = SwiGLU(ACT2FN["silu"], "silu")
    family.bind(formats)
    view = _slots()
    x = torch.randn(1, H, dtype=torch.bfloat16).to(DEVICE)
    apart = {e: {k: view(e, k).clone() for k in ("gate_up", "down")} for e in range(EXPERTS)}
    launches = _launches(monkeypatch)
    got = _plan(formats, True, family).experts(
        x, lambda kind: [apart[e][kind] for e in range(EXPERTS)], list(range(EXPERTS))
    )
    assert launches == []  # no grouped launch over views in several buffers
    assert torch.equal(got, _stages(family, formats, x, view, True))


def test_formats_without_a_batched_kernel_are_not_batched():
    """Plain bf16 experts: no batch, so the runtime builds no views before running the stages."""
    formats = {}
    for kind, shape in SHAPES.items():
        ref = TensorRef("unused", 0, 2 * shape[0] * shape[1], "BF16", shape, kind)
        formats[(0, kind)] = make_format(StoredFormat("BF16"), [ref], "cpu")
    formats[(0, "gate_up")] = formats[(0, "gate")].fused(formats[(0, "up")])
    family = SwiGLU(ACT2FN["silu"], "silu")
    assert not _plan(formats, True, family).batched
    gguf = _formats(fused=True)
    assert _plan(gguf, True, family).batched
    by_kind = {kind: fmt for (_, kind), fmt in gguf.items()}
    stages = family.stages(True)
    assert not SwitchLayer.choose(0, family, by_kind, stages, DEVICE, under_graphs=True).batched
    assert not SwitchLayer.choose(0, family, by_kind, stages, "mps", under_graphs=False).batched


@pytest.mark.parametrize("fused", [True, False])
def test_slot_tables_on_the_device_give_the_views_bits(fused):
    """The resident path (runtime/resident.py): offsets gathered on the device from a per-kind table by
    the routing's ids, no host list of views; the same launches, so the same bits as the views."""
    from moestream.runtime.formats.base import SlotTable

    formats = _formats(fused)
    family = SwiGLU(ACT2FN["silu"], "silu")
    family.bind(formats)
    view = _slots()
    storage = view(0, "gate").untyped_storage()
    buffer = torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(storage)
    kinds = ["gate_up", "down"] if fused else ["gate", "up", "down"]
    tables = {
        k: torch.tensor([view(e, k).data_ptr() - storage.data_ptr() for e in range(EXPERTS)], device=DEVICE)
        for k in kinds
    }
    routed = torch.tensor([2, 0], device=DEVICE)  # two of the three experts, in the routing's order
    x = (torch.randn(1, H, generator=torch.Generator().manual_seed(7)) * 0.5).to(DEVICE)
    plan = _plan(formats, fused, family)
    got = plan.experts(x, lambda kind: SlotTable(buffer, tables[kind][routed]), routed)
    want = plan.experts(x, lambda kind: [view(e, kind) for e in routed.tolist()], routed.tolist())
    assert torch.equal(got, want)
    assert got.shape == (2, 1, H) and not torch.equal(got[0], got[1])
    assert all(formats[(0, k)].accepts(1) for k in kinds)
