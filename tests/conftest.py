import os
import sys
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from several OpenMP threads, and on a loaded 2-core machine an OpenMP barrier
# waiting for a descheduled thread turns milliseconds into seconds. Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The same for ggml's pool (moestream's -t default): its threads spin at a barrier after every op.
os.environ.setdefault("MOESTREAM_THREADS", "1")

import torch

torch.set_num_threads(1)
# Without a GPU, moestream.kernels' Triton kernels run in Triton's CPU interpreter. Triton reads this
# when it is first imported, so it is set here, before any test module can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_lazy_dir_checked = False


def _linear_lazy_module_dir() -> None:
    """transformers' `_LazyModule.__dir__` checks each name of `__all__` against a list: quadratic in
    the ~5,000 names of the top-level module, 0.05 s a call. Every model load runs transformers'
    `apply_patches` (how moestream swaps in StreamingExperts), which calls dir() on every transformers
    module imported so far: 0.35 s of CPU of a tiny model's 0.4 s load, paid by hundreds of loads in
    this suite. The same list (same names, same order) from a set lookup; installed only where it gives
    exactly what transformers' own does, else transformers' is kept. Once transformers is imported (a
    process that never imports it, e.g. test_ggml_library's child, is not made to)."""
    global _lazy_dir_checked
    if _lazy_dir_checked or "transformers.utils.import_utils" not in sys.modules:
        return
    _lazy_dir_checked = True
    import transformers
    from transformers.utils import import_utils

    lazy = import_utils._LazyModule
    original = lazy.__dir__

    def linear_dir(self):
        result = list(super(lazy, self).__dir__())
        seen = set(result)
        for attr in self.__all__:
            if attr not in seen:
                result.append(attr)
                seen.add(attr)
        return result

    if isinstance(transformers, lazy) and linear_dir(transformers) == original(transformers):
        lazy.__dir__ = linear_dir


def pytest_runtest_setup(item):
    _linear_lazy_module_dir()  # before the test's fixtures, module and session ones included


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(arch) -> a checkpoint directory written once per session by transformers itself."""
    from tiny_models import write_tiny

    made = {}

    def make(arch: str, experts: int = 8, top_k: int = 2):
        key = (arch, experts, top_k)
        if key not in made:
            made[key] = write_tiny(
                arch, tmp_path_factory.mktemp(f"{arch}-{experts}-{top_k}"), experts=experts, top_k=top_k
            )
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, **write_gguf options) -> (HF directory, GGUF file), written once per session: a tiny
    model of `arch` with random vectors too, and the GGUF llama.cpp's converter would make of it."""
    from tiny_gguf import OVERRIDES, perturb_vectors, write_gguf
    from tiny_models import write_tiny

    made = {}

    def make(arch: str, **options):
        key = (arch, tuple(sorted(options.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(f"gguf-{arch}")
            hf = write_tiny(arch, root / "hf", **OVERRIDES.get(arch, {}))
            perturb_vectors(hf)
            made[key] = (hf, write_gguf(hf, root / "model.gguf", **options))
        return made[key]

    return make


@pytest.fixture(autouse=True)
def _no_cache_size_warnings():
    # budgets below a token's working set are the point of many tests; the warning has its own test
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cache budget .* smaller than one token's working set")
        yield
