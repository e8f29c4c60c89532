"""A step's last-position logits left on the device, beside their greedy token: what the ggml runner on a
backend returns to a caller that takes the argmax alone (`ModelRunner.forward`'s `greedy`, asked where
`Sampler.plain`), so that the step copies 12 bytes back a chunk of 128 logits (its chunked argmax), not
the vocabulary's floats."""

from __future__ import annotations

from collections.abc import Callable

import torch


class DeviceLogits:
    """`token`: the logits' argmax, numpy's (the first maximum); `tensor()`: the logits [V] f32 on the
    host, copied back on first call (`fetch`, which raises once a later step has overwritten them)."""

    __slots__ = ("_fetch", "_tensor", "token")

    def __init__(self, token: int, fetch: Callable[[], torch.Tensor]) -> None:
        self.token = token
        self._fetch = fetch
        self._tensor: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._fetch()
        return self._tensor
