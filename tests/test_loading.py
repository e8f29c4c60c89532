"""transformers builds the model but never reads an expert tensor; experts come only from the store."""

from __future__ import annotations

import re
import sys

import pytest
from tiny_models import ARCHS

import moestream

EXPERT_KEY = re.compile(r"\.experts\.")


def _spy(monkeypatch, log):
    """Log every checkpoint tensor transformers materializes from a moestream source."""
    from moestream.store.tensors import LazyTensor

    real = LazyTensor.__getitem__

    def getitem(self, index):
        log.append(self.ref.name)
        return real(self, index)

    monkeypatch.setattr(LazyTensor, "__getitem__", getitem)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_no_expert_tensor(arch, tiny_dir, monkeypatch):
    log: list[str] = []
    _spy(monkeypatch, log)
    engine = moestream.load(str(tiny_dir(arch)), cache="1MiB")
    engine.close()
    assert log, "the spy saw no reads at all: it is not on transformers' read path"
    assert any("embed_tokens" in key for key in log)
    assert [key for key in log if EXPERT_KEY.search(key)] == []


def test_spy_sees_expert_reads_of_the_stock_model(tiny_dir, monkeypatch):
    """Positive control: the same spy catches stock transformers (experts not replaced) reading expert
    tensors when they are offered through the same lazy state dict."""
    import transformers as T

    from moestream.store.source import open_source
    from moestream.store.tensors import LazyTensor

    log: list[str] = []
    _spy(monkeypatch, log)
    source = open_source(str(tiny_dir("qwen3_moe")))
    state = {name: LazyTensor(ref) for name, ref in source.tensors.items()}
    config = source.config()
    T.AutoModelForCausalLM._model_mapping[type(config)].from_pretrained(None, config=config, state_dict=state)
    assert any(EXPERT_KEY.search(key) for key in log)


def test_a_load_lists_transformers_modules_in_linear_time(tiny_dir, monkeypatch):
    """transformers 5.24's `_LazyModule.__dir__` is quadratic in its ~5,000 names, and a load's
    `apply_patches` calls dir() on every transformers module: 0.35 s of a tiny model's 0.4 s load. During
    a load the same list comes from a set lookup (moestream/model/lazy_dir.py); afterwards transformers'
    own is back, and both give the same names in the same order."""
    import transformers
    from transformers.utils import import_utils

    from moestream.model import lazy_dir

    lazy = import_utils._LazyModule
    original = lazy.__dir__
    assert lazy_dir._linear_dir(transformers) == original(transformers)
    linear, calls = lazy_dir._linear_dir, []

    def counted(self):
        calls.append(self.__name__)
        return linear(self)

    monkeypatch.setattr(lazy_dir, "_linear_dir", counted)
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB"):
        assert lazy.__dir__ is original  # only while the model is built
    assert "transformers" in calls  # the load's dir() of the top-level module went the linear way


def test_a_load_survives_an_alias_module_that_cannot_be_imported(tiny_dir, monkeypatch):
    """transformers 5.17-5.20 keep alias modules in sys.modules (`..._fast` image processors) whose
    dir() imports their target, and `apply_patches` takes dir() of every transformers module: without
    torchvision an image processor's import failed, and so did every load. The same alias, made here as
    transformers made it, with a target that cannot be imported: the load passes over it, and after
    the load its dir() raises again, as transformers' own does."""
    import importlib
    import types

    alias = types.ModuleType("transformers.models.fake_vision.image_processing_fake_vision_fast")
    alias.__file__ = None

    def target():
        return importlib.import_module("torchvision_missing_for_this_test")

    alias.__getattr__ = lambda name: getattr(target(), name)
    alias.__dir__ = lambda: dir(target())
    monkeypatch.setitem(sys.modules, alias.__name__, alias)
    with pytest.raises(ModuleNotFoundError):
        dir(alias)
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB"):
        pass
    with pytest.raises(ModuleNotFoundError):
        dir(alias)
