"""User-facing errors of the GPU clock floor and its daemon."""

from __future__ import annotations

from moestream.errors import MoestreamError


class GpuFloorError(MoestreamError):
    """The clock floor cannot run as asked: no GPU devfreq node, no permission, bad settings."""
