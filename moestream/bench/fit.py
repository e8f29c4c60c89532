"""Summary statistics and the decode-time model: time per token = fixed ms + ms per MiB x MiB read per token.

Fitted by ordinary least squares over the requests of one or more runs (runs that read different
volumes per token, e.g. top-k 8 and a lossy top-k 4, span the line). The fixed part is what a token
costs with nothing read, so 1000 / fixed_ms is the decode speed no read path can beat.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def cv(values: list[float]) -> float | None:
    """Coefficient of variation: sample standard deviation / mean (None below two values)."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    if m == 0:
        return None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var) / m


@dataclass(frozen=True)
class LineFit:
    """y = fixed_ms + ms_per_mib * x over `points` requests; y_min is the fastest request's ms/token."""

    fixed_ms: float
    ms_per_mib: float
    r2: float
    points: int
    x_min: float
    x_max: float
    y_min: float | None = None

    @property
    def warning(self) -> str | None:
        """Why the line cannot give a ceiling, or None when it can."""
        if self.ms_per_mib < 0:
            return (
                f"the fitted slope is negative ({self.ms_per_mib:.3f} ms/MiB: the runs that read more were "
                "faster), so the line does not describe the cost of reading"
            )
        if self.fixed_ms <= 0:
            return f"the fixed part is {self.fixed_ms:.1f} ms <= 0, so the line has no ceiling"
        if self.y_min is not None and self.y_min < self.fixed_ms:
            return (
                f"the ceiling with no reads ({1000.0 / self.fixed_ms:.2f} tok/s) is below a measured run "
                f"({1000.0 / self.y_min:.2f} tok/s), so the line does not hold near zero reads"
            )
        return None

    @property
    def ceiling_tok_s(self) -> float | None:
        """Decode speed with zero bytes read, as the line extrapolates it (None: `warning` says why)."""
        return 1000.0 / self.fixed_ms if self.warning is None else None

    def predict(self, mib_per_token: float) -> float:
        return self.fixed_ms + self.ms_per_mib * mib_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ceiling_tok_s": self.ceiling_tok_s, "warning": self.warning}

    def line(self) -> str:
        ceiling = (
            f"{self.ceiling_tok_s:.2f} tok/s" if self.ceiling_tok_s else f"none (WARNING: {self.warning})"
        )
        return (
            f"time/token = {self.fixed_ms:.1f} ms + {self.ms_per_mib:.3f} ms/MiB x MiB/token "
            f"(R^2 {self.r2:.3f}, {self.points} requests, {self.x_min:.0f}-{self.x_max:.0f} MiB/token); "
            f"ceiling with no reads {ceiling}"
        )


def fit_line(xs: list[float], ys: list[float]) -> LineFit | None:
    """Least-squares line through (x, y); None with fewer than 3 points or when every x is the same.

    R^2 = 1 - residual sum of squares / total sum of squares (1.0 when every y is the same and fitted).
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 1e-12 * max(1.0, mx * mx) * n:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    fixed = my - slope * mx
    ss_res = sum((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LineFit(fixed, slope, r2, n, min(xs), max(xs), min(ys))
