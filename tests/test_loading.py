"""transformers builds the model but never reads an expert tensor; experts come only from the store."""

from __future__ import annotations

import re

import pytest
import transformers.modeling_utils as modeling_utils

import moestream
from tiny_models import ARCHS

EXPERT_KEY = re.compile(r"\.experts\.")


class _SliceSpy:
    def __init__(self, inner, key, log):
        self._inner, self._key, self._log = inner, key, log

    def __getitem__(self, item):
        self._log.append(self._key)
        return self._inner[item]

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _FileSpy:
    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def get_slice(self, key):
        return _SliceSpy(self._inner.get_slice(key), key, self._log)

    def get_tensor(self, key):
        self._log.append(key)
        return self._inner.get_tensor(key)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_no_expert_tensor(arch, tiny_dir, monkeypatch):
    real = modeling_utils.safe_open
    log: list[str] = []
    monkeypatch.setattr(modeling_utils, "safe_open", lambda *a, **k: _FileSpy(real(*a, **k), log))
    engine = moestream.load(str(tiny_dir(arch)), cache="1MiB")
    engine.close()
    assert log, "the spy saw no reads at all: it is not on transformers' read path"
    assert any("embed_tokens" in key for key in log)
    assert [key for key in log if EXPERT_KEY.search(key)] == []


def test_spy_sees_expert_reads_of_the_stock_model(tiny_dir, monkeypatch):
    """Positive control: the same spy catches stock transformers reading expert tensors."""
    import transformers as T

    real = modeling_utils.safe_open
    log: list[str] = []
    monkeypatch.setattr(modeling_utils, "safe_open", lambda *a, **k: _FileSpy(real(*a, **k), log))
    T.AutoModelForCausalLM.from_pretrained(tiny_dir("qwen3_moe"))
    assert any(EXPERT_KEY.search(key) for key in log)
