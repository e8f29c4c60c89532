"""Output files that appear whole or not at all, and the checks that let a run fail before it starts.

A trace or an export is written to a temporary name beside its final name and renamed over it once
complete, so a reader never sees half a file; if writing fails (a full disk, say) the temporary file is
removed, so nothing is left behind but what was there before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from moestream.trace.errors import TraceError


def check_output_path(path: str | os.PathLike[str], what: str = "trace") -> Path:
    """Fail now, with the reason, if a file cannot be created at `path` (before a long run produces it).

    Raises:
        TraceError: `path` is a directory, or its directory is missing, not a directory or not writable.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise TraceError(f"the {what} output {path} is a directory; name a file in it instead")
    if not parent.exists():
        raise TraceError(f"cannot write the {what} to {path}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise TraceError(f"cannot write the {what} to {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TraceError(f"cannot write the {what} to {path}: the directory {parent} is not writable")
    return path


def temporary_path(path: Path) -> Path:
    """The name a file is written under before it is renamed to `path` (hidden, unique to this process)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def describe(exc: OSError) -> str:
    """An OSError's reason as a short phrase (Arrow's errors carry no strerror, only a message)."""
    return exc.strerror or " ".join(str(exc).split())


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], what: str = "trace") -> Iterator[Path]:
    """Yields a temporary path to write; on success it is renamed to `path`, on any failure removed.

    Raises:
        TraceError: the output cannot be created or writing it failed (an OSError inside the block).
    """
    path = check_output_path(path, what)
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TraceError(f"writing the {what} {path} failed: {describe(exc)}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
