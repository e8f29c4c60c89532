"""transformers' module `dir()` in linear time while moestream builds a model.

transformers 5.24's `_LazyModule.__dir__` checks each name of `__all__` against a list: quadratic in the
~5,000 names of the top-level module (0.05 s a call). A model load runs transformers' `apply_patches`
(how the experts class is swapped for `StreamingExperts`), which calls dir() on every transformers module
imported so far: 0.35 s of CPU of a tiny model's 0.4 s load, paid by every `moestream generate` and
server start. `linear_lazy_dir` gives the same list (same names, same order) from a set lookup for the
duration of a load, where it is checked once to equal transformers' own; else transformers' is kept.

transformers 5.17-5.20 also keep alias modules in `sys.modules` (`transformers.models.X.
image_processing_X_fast` and a few more) whose dir() imports the module they stand for; many image
processors import torchvision, so `apply_patches` raised ModuleNotFoundError and no model built where
torchvision is not installed (5.21 replaced the aliases with an import hook). `tolerant_alias_dirs` gives
such an alias an empty dir() where its module cannot be imported, for the duration of a load: no experts
class lives in an image processor, and any module that did import is listed under its own name.
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


def _alias_modules() -> list[Any]:
    """transformers' alias modules (5.17-5.20): a plain module of a transformers name with `__file__`
    None and a `__dir__` of its own, which imports its target."""
    found = []
    for module in list(sys.modules.values()):
        own = getattr(module, "__dict__", None)
        if not isinstance(own, dict) or not str(own.get("__name__", "")).startswith("transformers."):
            continue
        if own.get("__file__", "") is None and callable(own.get("__dir__")):
            found.append(module)
    return found


@contextlib.contextmanager
def tolerant_alias_dirs() -> Iterator[None]:
    """Within the block, dir() of a transformers alias module whose target cannot be imported (an image
    processor without torchvision) is empty instead of raising ImportError."""
    replaced = []
    for module in _alias_modules():
        original = module.__dict__["__dir__"]
        if getattr(original, "_moestream_tolerant", False):  # an enclosing block's
            continue

        def tolerant(original: Any = original) -> list[str]:
            try:
                return original()
            except ImportError:
                return []

        tolerant._moestream_tolerant = True  # type: ignore[attr-defined]
        module.__dir__ = tolerant
        replaced.append((module, original))
    try:
        yield
    finally:
        for module, original in replaced:
            module.__dir__ = original
