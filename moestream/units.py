"""Byte sizes as users write them ("512MiB", "2GiB", "1.5G", "4096") and as we print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str | int) -> int:
    """Parse a byte size such as "512MiB", "2GiB", "1.5G" or 4096 into bytes.

    Single-letter suffixes (K, M, G, T) are binary, like llama.cpp and most tools; "MB"/"GB" are decimal.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte size cannot be negative: {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 512MiB, 2GiB, 1.5G, 4096)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Format bytes with a binary unit, e.g. 536870912 -> "512.0 MiB"."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple
