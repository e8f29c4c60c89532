"""`--device cuda`'s one GPU path (engine/gpu_path.py, issue 31): ggml's CUDA backend wherever the ggml
graphs run the model, its CUDA library loads and sees a GPU, and no torch-path option was asked for;
else the torch CUDA path, the mode line saying why. The rule (`choose`) over every input; the options'
mapping (`ggml_options`) and its refusals; and a run of `--device cuda` resolved onto ggml's CUDA
backend, here with ggml's CPU backend standing in for it (the probe and the backend's factory replaced),
whose tokens equal the CPU graphs'."""

from __future__ import annotations

import itertools
import json
import types

import pytest

import moestream
from moestream.cli import main
from moestream.engine.gpu_path import (
    CPU,
    GGML_CUDA,
    TORCH,
    TORCH_TRUNKS,
    GpuPath,
    choose,
    ggml_options,
    gpu_index,
    resolve,
)
from moestream.engine.options import TRUNK_MODES, EngineOptions
from moestream.errors import MoestreamError

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
GREEDY = 8
NO_GRAPH = "foo has no ggml graph yet"
NO_CUDA = "ggml's CUDA library not found; `make native CUDA=1` builds it"


@pytest.mark.parametrize(
    "device,trunk,unified,no_graph,missing",
    list(
        itertools.product(
            ["cpu", "cuda", "cuda:1"], TRUNK_MODES, [False, True], [None, NO_GRAPH], [None, NO_CUDA]
        )
    ),
)
def test_the_rule_over_every_input(device, trunk, unified, no_graph, missing):
    """CPU for the CPU; on a GPU ggml's CUDA backend unless a torch trunk or --unified was asked for, the
    graphs do not run the model, or the backend cannot run here, the first of these being the words why;
    --trunk ggml on a GPU where the backend cannot run is refused, not moved to the torch path."""
    if device == "cpu":
        assert choose(device, trunk, unified, no_graph, missing) == GpuPath(CPU)
        return
    if trunk in TORCH_TRUNKS:
        want = (TORCH, f"--trunk {trunk} asked")
    elif unified:
        want = (TORCH, "--unified: one device-mapped tier")
    elif no_graph is not None:
        want = (TORCH, f"the ggml graphs do not run this model: {no_graph}")
    elif missing is not None:
        want = (TORCH, missing)
    else:
        want = (GGML_CUDA, "")
    if trunk == "ggml" and want[0] == TORCH:  # --unified too: the torch path's tier
        with pytest.raises(
            MoestreamError, match=rf"^--trunk ggml --device {device} runs ggml's CUDA backend"
        ):
            choose(device, trunk, unified, no_graph, missing)
        return
    got = choose(device, trunk, unified, no_graph, missing)
    assert (got.path, got.why) == want


@pytest.mark.parametrize(
    "given,cache,tier",
    [
        ({}, "auto", "auto"),
        ({"cache": "12GiB"}, "12GiB", "auto"),
        ({"host_cache": "12GiB"}, "12GiB", "auto"),
        ({"cache": "12GiB", "host_cache": "12GiB"}, "12GiB", "auto"),
        ({"cache": "12GiB", "host_cache": "auto"}, "12GiB", "auto"),
        ({"gpu_cache": "2GiB"}, "auto", "2GiB"),
        ({"gpu_tier": "2GiB"}, "auto", "2GiB"),
        ({"gpu_tier": "2GiB", "gpu_cache": "2048MiB"}, "auto", "2GiB"),
        ({"gpu_cache": "auto"}, "auto", "auto"),
        ({"gpu_tier": "auto", "cache": "5GiB"}, "5GiB", "auto"),
        ({"cache": "5GiB", "gpu_cache": "2GiB", "unified": False}, "5GiB", "2GiB"),
    ],
)
def test_the_ggml_path_options(given, cache, tier):
    """--cache (or --host-cache) the host expert cache, --gpu-tier (or --gpu-cache) the GPU tier, auto by
    default; the torch path's tier options gone, the GPU named."""
    out = ggml_options("cuda:1", {"cache": "auto", **given, "policy": "lfu"})
    assert out["cache"] == cache and out["gpu_tier"] == tier and out["ggml_device"] == "cuda:1"
    assert out["policy"] == "lfu" and not {"gpu_cache", "host_cache", "unified"} & set(out)


@pytest.mark.parametrize(
    "given,words",
    [
        ({"cache": "12GiB", "host_cache": "8GiB"}, "--cache 12GiB and --host-cache 8GiB both size one tier"),
        (
            {"gpu_tier": "2GiB", "gpu_cache": "1GiB"},
            "--gpu-tier 2GiB and --gpu-cache 1GiB both size one tier",
        ),
        ({"host_cache": "0"}, "--host-cache 0 (pinned staging only) is the torch CUDA path's"),
    ],
)
def test_contradictory_sizes_are_refused_in_one_sentence(given, words):
    with pytest.raises(MoestreamError) as err:
        ggml_options("cuda", {"cache": "auto", **given})
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_gpu_index():
    assert gpu_index("cuda") == 0 and gpu_index("cuda:3") == 3
    with pytest.raises(MoestreamError, match="say cuda or cuda:N"):
        gpu_index("cuda:x")


def _probe(monkeypatch, missing: str | None) -> None:
    """ggml's CUDA backend runs here (`missing` None: a discrete GPU), or cannot for the words `missing`."""
    monkeypatch.setattr("moestream.ggml.backend.cuda_unavailable", lambda device=0: missing)
    monkeypatch.setattr(
        "moestream.ggml.backend.cuda_device_type", lambda device=0: "gpu" if missing is None else None
    )


def test_resolve_from_the_config(monkeypatch):
    """The config decides whether the graphs run the model; the probe whether the backend runs here; a
    torch-path option wins; --gpu-tier on the torch path is refused, the words saying why it is that path."""
    _probe(monkeypatch, None)
    config = types.SimpleNamespace(model_type="qwen3_moe", hidden_act="silu")
    device, options, chosen = resolve(config, "cuda", {"cache": "4GiB", "gpu_cache": "1GiB"})
    assert (device, chosen.path) == ("cpu", GGML_CUDA)
    assert options == {"cache": "4GiB", "gpu_tier": "1GiB", "ggml_device": "cuda"}
    device, options, chosen = resolve(config, "cuda", {"cache": "4GiB", "trunk": "graphs"})
    assert (device, chosen.path, options["gpu_path_why"]) == ("cuda", TORCH, "--trunk graphs asked")
    device, options, chosen = resolve(config, "cuda", {"cache": "4GiB", "unified": True})
    assert (device, chosen.path) == ("cuda", TORCH) and "unified" in options
    gelu = types.SimpleNamespace(model_type="qwen3_moe", hidden_act="gelu")
    _, options, chosen = resolve(gelu, "cuda", {})
    assert (
        options["gpu_path_why"]
        == "the ggml graphs do not run this model: activation 'gelu' is not in the graphs yet"
    )
    _probe(monkeypatch, NO_CUDA)
    _, options, _ = resolve(config, "cuda", {"cache": "auto"})
    assert options["gpu_path_why"] == NO_CUDA
    with pytest.raises(
        MoestreamError,
        match=r"^--gpu-tier sizes the GPU tier of ggml's CUDA backend, which does not run here \(ggml's CUDA",
    ):
        resolve(config, "cuda", {"gpu_tier": "1GiB"})
    assert resolve(config, "cpu", {"cache": "1GiB"}) == ("cpu", {"cache": "1GiB"}, GpuPath(CPU))


def test_without_the_library_the_torch_path_says_why(tiny_dir, capsys):
    """This machine: no libggml-cuda, no GPU. --device cuda takes the torch path, which torch refuses here,
    the sentence saying why the torch path was taken; a non-zero exit, no traceback."""
    with pytest.raises(MoestreamError) as err:
        moestream.load(str(tiny_dir("qwen3_moe")), device="cuda", cache="64MiB")
    text = str(err.value)
    assert "sees no CUDA device (the torch CUDA path, as ggml's CUDA library not found" in text
    assert "\n" not in text
    code = main(["generate", str(tiny_dir("qwen3_moe")), "--device", "cuda", "--prompt", "Hi", "-n", "2"])
    err_text = capsys.readouterr().err
    assert code != 0 and "make native CUDA=1" in err_text and "Traceback" not in err_text


@pytest.mark.parametrize(
    "argv,words",
    [
        (
            ["--gpu-cache", "1MiB", "--gpu-tier", "2MiB"],
            "--gpu-tier 2MiB and --gpu-cache 1MiB both size one tier",
        ),
        (
            ["--cache", "64MiB", "--host-cache", "32MiB"],
            "--cache 64MiB and --host-cache 32MiB both size one tier",
        ),
        (["--trunk", "graphs", "--gpu-tier", "2MiB"], "--gpu-tier sizes the GPU tier of ggml's CUDA backend"),
    ],
)
def test_the_cli_refuses_contradictions(argv, words, tiny_dir, capsys, monkeypatch):
    _probe(monkeypatch, None)
    code = main(
        ["generate", str(tiny_dir("qwen3_moe")), "--device", "cuda", *argv, "--prompt", "Hi", "-n", "2"]
    )
    err = capsys.readouterr().err
    assert code != 0 and words in err and "Traceback" not in err


def _cpu_standing_in(monkeypatch, free: int = 8 << 30) -> list[int]:
    """ggml's CUDA backend replaced by ggml's CPU backend saying `free` bytes are free; the GPUs asked for."""
    from moestream.ggml.backend import Backend, cpu_backend

    class Stand(Backend):
        def memory(self) -> tuple[int, int]:
            return free, 2 * free

    asked: list[int] = []

    def fake(device: int = 0) -> Backend:
        asked.append(device)
        b = cpu_backend(2)
        return Stand(b.lib, b.handle, b.buft, b.kind, "stand-in for CUDA", b.device)

    _probe(monkeypatch, None)
    monkeypatch.setattr("moestream.ggml.backend.cuda_backend", fake)
    monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    return asked


def _greedy(path, **load) -> tuple[list[int], str]:
    with moestream.load(str(path), ctx_size=64, **load) as engine:
        return engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True).tokens, engine.mode_line()


@pytest.mark.parametrize("which", ["qwen3_moe", "mixtral"])
def test_device_cuda_runs_the_ggml_graphs_on_the_backend(which, tiny_dir, monkeypatch):
    """--device cuda on ggml's CUDA backend (ggml's CPU backend standing in): the tokens of the CPU graphs,
    every expert on the device by auto where they fit, a GPU tier of --gpu-cache's size where asked."""
    path = tiny_dir(which)
    monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    want, _ = _greedy(path, cache="64MiB")
    asked = _cpu_standing_in(monkeypatch)
    got, mode = _greedy(path, device="cuda:1", cache="64MiB")
    assert got == want and asked == [1]
    assert (
        f"{which} on cuda:1 |" in mode
        and "trunk ggml graphs on ggml's cpu backend (stand-in for CUDA" in mode
    )
    assert "--gpu-tier auto: every expert on the device" in mode
    assert "8 io threads" in mode  # ggml's CUDA backend's default (4 on the CPU)
    tiered, mode = _greedy(path, device="cuda", host_cache="64MiB", gpu_cache="1MiB", io_threads=3)
    assert tiered == want and "GPU tier" in mode and "3 io threads" in mode


def test_io_threads_default_by_backend():
    """4 I/O threads by default; 8 on ggml's CUDA backend; a number given wins on either."""
    assert EngineOptions().io_threads == 4
    assert EngineOptions(ggml_device="cuda").io_threads == 8
    assert EngineOptions(ggml_device="cuda", io_threads=2).io_threads == 2
    assert EngineOptions(io_threads=16).io_threads == 16


def test_device_cuda_json_and_env_conflict(tiny_dir, monkeypatch, capsys):
    """The CLI's --device cuda on the stand-in gives the CPU's tokens; MOESTREAM_GGML_BACKEND=cpu beside it
    asks for two backends and is refused in one sentence."""
    path = str(tiny_dir("qwen3_moe"))
    monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    argv = ["generate", path, "--prompt", "Hello", "-n", "4", "--json", "--cache", "64MiB"]
    assert main(argv) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    _cpu_standing_in(monkeypatch)
    assert main([*argv, "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    assert main([*argv, "--device", "cuda"]) != 0
    assert "MOESTREAM_GGML_BACKEND=cpu and --device cuda ask for two backends" in capsys.readouterr().err


def test_the_resolved_fields_are_not_given(tiny_dir):
    with pytest.raises(MoestreamError, match="ggml_device: set at load by --device cuda, not given"):
        moestream.load(str(tiny_dir("qwen3_moe")), ggml_device="cuda")


def test_restream_on_the_backend_takes_the_host_cache_only(tiny_dir, monkeypatch):
    _cpu_standing_in(monkeypatch)
    engine = moestream.load(str(tiny_dir("qwen3_moe")), device="cuda", cache="64MiB", ctx_size=64)
    with engine, pytest.raises(MoestreamError, match=r"restream resizes the host expert cache \(cache\)"):
        engine.restream(gpu_cache="1MiB")


def test_what_only_the_built_model_shows_is_refused(tiny_dir, monkeypatch):
    """The config promised graphs; the built model has a part they lack: one sentence naming the torch
    path's trunks, not a silent move to another path after the memory was planned for this one."""
    from moestream.graphs import NoGraph

    def no_graph(model, config):
        raise NoGraph("clip_qkv is not in the graphs yet")

    _cpu_standing_in(monkeypatch)
    monkeypatch.setattr("moestream.graphs.graph_spec", no_graph)
    with pytest.raises(MoestreamError) as err:
        moestream.load(str(tiny_dir("qwen3_moe")), device="cuda", cache="64MiB", ctx_size=64)
    assert str(err.value) == (
        "--device cuda chose ggml's CUDA backend, and the ggml graphs cannot run this model (clip_qkv is not "
        "in the graphs yet): --trunk graphs or eager runs it on the torch CUDA path"
    )


@pytest.mark.parametrize(
    "trunk,unified,want",
    [
        ("auto", None, TORCH),
        ("ggml", None, GGML_CUDA),
        ("auto", False, GGML_CUDA),
        ("auto", True, TORCH),
    ],
)
def test_an_integrated_gpu_keeps_the_unified_tier(monkeypatch, trunk, unified, want):
    """On an integrated GPU (Jetson) --device cuda keeps the torch path's one device-mapped tier unless
    --trunk ggml or --unified false asks for ggml's CUDA backend (which would hold the experts twice in the
    one memory); the mode line's words say so."""
    import moestream.engine.gpu_path as gp

    monkeypatch.setattr(gp, "_integrated", lambda device: True)
    monkeypatch.setattr("moestream.ggml.backend.cuda_unavailable", lambda index: None)
    monkeypatch.setattr("moestream.graphs.config_no_graph", lambda config: None)
    given = {"cache": "4GiB", "trunk": trunk} | ({} if unified is None else {"unified": unified})
    device, _, chosen = resolve(object(), "cuda", given)
    assert device == ("cpu" if want == GGML_CUDA else "cuda")
    assert chosen.path == want
    if want == TORCH and unified is None:
        assert chosen.why == "an integrated GPU: one device-mapped tier, as --unified"


@pytest.mark.parametrize("kind,want", [("gpu", False), ("igpu", True)])
def test_the_integrated_check_asks_ggml_before_torch(monkeypatch, kind, want):
    """Where ggml's CUDA backend runs, the integrated-GPU check is its device type, and torch's CUDA is not
    asked (starting it costs host memory the expert cache could have); where it does not, torch is."""
    import torch

    import moestream.engine.gpu_path as gp

    def not_asked(*a, **k):
        raise AssertionError("torch's CUDA was asked")

    monkeypatch.setattr(torch.cuda, "get_device_properties", not_asked)
    monkeypatch.setattr(torch.cuda, "is_available", not_asked)
    monkeypatch.setattr("moestream.ggml.backend.cuda_device_type", lambda device: kind)
    assert gp._integrated("cuda:0") is want

    props = types.SimpleNamespace(is_integrated=not want)
    monkeypatch.setattr("moestream.ggml.backend.cuda_device_type", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert gp._integrated("cuda:0") is (not want)
