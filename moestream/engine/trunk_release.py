"""The trunk on a ggml backend: every tensor its graphs read copied to the device at load, then the host
copy given back, so that on ggml's CUDA backend the trunk (attention, norms, embeddings, the LM head,
shared experts) takes no host memory but the routers'.

Weights used to be copied when a graph first read them (`DeviceMemory.translate`), and graphs are built
whenever a new step shape comes (a prefill of another length, a batch, a longer span): a weight first
read after its host pages were given back would have been copied as zeros. So, at load, before the
expert cache is taken:

- every tensor of the graphs' spec (`spec_tensors`) is copied to the device (`upload_weights`);
- the pages of the trunk's host tensors (the model's parameters and buffers, the spec's own copies: norms
  and routers in float32, MLA's k_b) are given back (`drop_pages`, MADV_DONTNEED: anonymous memory the
  process keeps allocated, so that no later tensor takes the addresses the graphs name the device's
  copies by), unlocked first where --lock-memory locked them;
- a graph that reads a given-back range outside what was copied raises (`DeviceMemory.release_host`),
  and the model's given-back parameters and buffers become `Released` tensors, which raise on any use
  but their shape, dtype and device: transformers' forward over them would compute with zeros.

Kept on the host: the tensors of the router modules (`router_modules`), which the stale-gate lookahead
(--prefetch) and traces' predictions run on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moestream.engine.memory import TrunkLock
from moestream.ggml.backend import DeviceMemory, merged_ranges
from moestream.graphs.spec import ModelSpec, spec_tensors
from moestream.io.memory import drop_pages
from moestream.model.loader import router_modules


@dataclass(frozen=True)
class TrunkOnDevice:
    """What `upload_trunk` did: bytes copied to the device (ggml's `kind` backend), bytes of host pages
    given back, and the routers' bytes kept on the host."""

    kind: str
    placed: int
    released: int
    kept: int


class Released(torch.Tensor):
    """A trunk tensor whose host copy was given back (its data on the device): its shape, dtype and
    device can be read, any computation over it raises."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "__get__":  # a property: shape, dtype, device, ...
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            "this trunk tensor's host copy was given back at load: on a ggml backend the trunk lives on "
            "the device and the ggml graphs compute it (transformers' forward cannot run here; load with "
            "--device cpu for that)"
        )


def released(t: torch.Tensor) -> Released:
    """A `Released` stand-in of `t` (its shape and dtype, no memory)."""
    return torch.Tensor._make_subclass(Released, torch.empty_like(t, device="meta"), False)


def upload_trunk(
    model: torch.nn.Module, spec: ModelSpec, memory: DeviceMemory, lock: TrunkLock
) -> TrunkOnDevice:
    """Copy every tensor of `spec` to `memory`'s device and give the trunk's host pages back (the module
    doc): the routers' tensors stay. `lock` (the trunk's) then locks only those."""
    placed = memory.upload_weights([(f"spec.{name}", t) for name, t in spec_tensors(spec)])
    routers = [t for m in router_modules(model).values() for t in (*m.parameters(), *m.buffers())]
    kept = merged_ranges([_storage(t) for t in routers if t.device.type == "cpu" and t.numel()])
    host = [(t.data_ptr(), t.data_ptr() + t.nbytes) for _, t in spec_tensors(spec) if t.numel()]
    owned = [t for t in _tensors(model) if t.device.type == "cpu" and t.untyped_storage().nbytes()]
    host += [_storage(t) for t in owned]
    given = [r for r in merged_ranges(host) if not any(_meet(r, k) for k in kept)]
    lock.keep_only(kept)
    holders = [t.untyped_storage() for t in owned if any(_meet(_storage(t), r) for r in given)]
    dropped = sum(drop_pages(start, end - start) for start, end in given)
    memory.release_host(given, holders)
    _replace(model, given)
    return TrunkOnDevice(memory.backend.kind, placed, dropped, sum(end - start for start, end in kept))


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of the model's modules (a tied one once per module holding it)."""
    tables = [table for m in model.modules() for table in (m._parameters, m._buffers)]
    return [t for table in tables for t in table.values() if t is not None]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _replace(model: torch.nn.Module, given: list[tuple[int, int]]) -> None:
    """Every parameter and buffer of the model whose storage meets a given-back range made `Released`
    (one stand-in per tensor: tied weights stay tied)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or not any(_meet(_storage(t), r) for r in given):
                    continue
                if id(t) not in made:
                    made[id(t)] = released(t)
                table[name] = made[id(t)]
