"""transformers' module `dir()` in linear time while moestream builds a model.

transformers 5.24's `_LazyModule.__dir__` checks each name of `__all__` against a list: quadratic in the
~5,000 names of the top-level module (0.05 s a call). A model load runs transformers' `apply_patches`
(how the experts class is swapped for `StreamingExperts`), which calls dir() on every transformers module
imported so far: 0.35 s of CPU of a tiny model's 0.4 s load, paid by every `moestream generate` and
server start. `linear_lazy_dir` gives the same list (same names, same order) from a set lookup for the
duration of a load, where it is checked once to equal transformers' own; else transformers' is kept.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_CHECKED: bool | None = None  # whether the linear version equals transformers' (checked once)


def _lazy_class() -> Any:
    try:
        from transformers.utils import import_utils

        return import_utils._LazyModule
    except (ImportError, AttributeError):  # another transformers: nothing to speed up
        return None


def _linear_dir(self: Any) -> list[str]:
    result = list(super(_lazy_class(), self).__dir__())  # the module's own names, as transformers does
    seen = set(result)
    for attr in self.__all__:
        if attr not in seen:
            result.append(attr)
            seen.add(attr)
    return result


def _usable(lazy: Any) -> bool:
    global _CHECKED
    if _CHECKED is None:
        top = sys.modules.get("transformers")
        try:
            _CHECKED = isinstance(top, lazy) and _linear_dir(top) == lazy.__dir__(top)
        except Exception:  # any surprise: keep transformers' own
            _CHECKED = False
    return _CHECKED


@contextlib.contextmanager
def linear_lazy_dir() -> Iterator[None]:
    """transformers' `_LazyModule.__dir__` in linear time within the block (the same result)."""
    lazy = _lazy_class()
    if lazy is None or not _usable(lazy) or lazy.__dir__ is _linear_dir:
        yield
        return
    original = lazy.__dir__
    lazy.__dir__ = _linear_dir
    try:
        yield
    finally:
        lazy.__dir__ = original
