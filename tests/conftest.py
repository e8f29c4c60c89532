import os
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


@pytest.fixture
def torch_cuda_path(monkeypatch):
    """`--device cuda` takes the torch CUDA path (transformers' CUDA graphs, the Triton GGUF kernels) even
    where ggml's CUDA library is built: the tests of that path (engine/gpu_path.py's fallback)."""
    monkeypatch.setattr(
        "moestream.ggml.backend.cuda_unavailable", lambda device=0: "the test asks for the torch CUDA path"
    )
