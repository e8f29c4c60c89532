"""Finding the libllama.so files to probe, and noticing when a rebuild replaced one.

A uprobe is bound to the inode it was placed on: after llama.cpp is rebuilt, the new library is a new
file and the old probes never fire again. The daemon therefore re-resolves the configured paths every
few seconds and compares each file's identity (device, inode, size, mtime).
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass

from moestream.power.elfsyms import ElfError, exported_functions
from moestream.power.settings import PATH_RE

log = logging.getLogger("moestream.power")


@dataclass(frozen=True)
class LibraryRef:
    """One resolved library file: its real path, identity and the watched symbols it exports."""

    path: str
    identity: tuple[int, int, int, int]
    symbols: tuple[str, ...]


def resolve_libraries(patterns: tuple[str, ...], symbols: tuple[str, ...]) -> list[LibraryRef]:
    """Existing files matching `patterns` (globs allowed), real paths, without duplicates.

    A file whose real path holds characters that cannot go into a bpftrace probe, or which exports
    none of `symbols`, is skipped with a warning rather than attached.
    """
    found: dict[str, LibraryRef] = {}
    for pattern in patterns:
        for match in sorted(glob.glob(pattern)):
            real = os.path.realpath(match)
            if real in found or not os.path.isfile(real):
                continue
            ref = describe_library(real, symbols)
            if ref is not None:
                found[real] = ref
    return list(found.values())


def describe_library(real: str, symbols: tuple[str, ...]) -> LibraryRef | None:
    """A LibraryRef for the file at real path `real`, or None (with a warning) when unusable."""
    if not PATH_RE.fullmatch(real):
        log.warning("skipping %r: its path holds characters not allowed in a probe", real)
        return None
    try:
        st = os.stat(real)
        exported = exported_functions(real)
    except (OSError, ElfError) as exc:
        log.warning("skipping %s: %s", real, exc)
        return None
    present = tuple(s for s in symbols if s in exported)
    if not present:
        log.warning("skipping %s: it exports none of %s", real, ", ".join(symbols))
        return None
    return LibraryRef(real, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), present)
