"""Byte-level torch views of the cache's slot buffers (what tiers hand to weight formats)."""

from __future__ import annotations

import torch

from moestream.io.memory import AlignedBuffer


class SlotTensors:
    """Byte-level torch views of slot buffers, made once per buffer."""

    def __init__(self) -> None:
        self._bytes: dict[int, torch.Tensor] = {}

    def bytes_of(self, buffer: AlignedBuffer) -> torch.Tensor:
        """The whole buffer as a uint8 tensor (no copy)."""
        whole = self._bytes.get(id(buffer))
        if whole is None:
            whole = torch.frombuffer(buffer.view, dtype=torch.uint8)
            self._bytes[id(buffer)] = whole
        return whole
