"""Install as documented: the license, the extras the README names, one sentence naming the extra when a
verb's optional dependency is missing (simulated by blocking the import in a fresh interpreter), the
Makefile's torch choice, --version and llama.cpp's short flags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moestream import __version__
from moestream.cli import EXTRA_OF_MODULE, build_parser, main

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_apache_2_with_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )
    major = int(re.search(r"setuptools>=(\d+)", PYPROJECT["build-system"]["requires"][0]).group(1))
    assert major >= 77  # the first setuptools that takes SPDX strings without the deprecation warning


def test_readme_names_every_extra_and_each_module_maps_to_one():
    extras = PYPROJECT["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    for name in ("server", "trace", "bench"):
        assert f"moestream[{name}]" in readme, name
    declared = " ".join(" ".join(deps) for deps in extras.values()).lower().replace("-", "_")
    for module, extra in EXTRA_OF_MODULE.items():
        assert extra in extras
        if module != "starlette":  # comes with fastapi
            assert module.replace("-", "_") in declared, module
    assert any(dep.startswith("httpx") for dep in extras["bench"])  # bench's HTTP client


@pytest.mark.parametrize(
    "verb, argv, blocked, extra",
    [
        ("serve", ["serve", "PATH"], ["uvicorn", "fastapi"], "server"),
        ("simulate", ["simulate", "trace.parquet"], ["pyarrow"], "trace"),
        ("bench", ["bench", "--target", "http://127.0.0.1:9", "--out", "OUT"], ["httpx"], "bench"),
    ],
)
def test_a_missing_extra_is_named_in_one_sentence(tmp_path, verb, argv, blocked, extra):
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # as if not installed\n"
        "from moestream.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"moestream: error: `moestream {verb}` needs the '{extra}' extra ({blocked[0]} is not "
        f"installed): pip install 'moestream[{extra}]'"
    ]


def test_makefile_chooses_a_cpu_torch_and_keeps_a_users_own():
    make = (ROOT / "Makefile").read_text()
    assert "TORCH_INDEX ?= https://download.pytorch.org/whl/cpu" in make
    assert '--index-url "$(TORCH_INDEX)"' in make and "--no-index" in make
    assert 'if $(PY) -c "import torch"' in make  # a torch already in the venv (a GPU build) is kept
    assert not any(dep.startswith("torch=") for dep in PYPROJECT["project"]["dependencies"])


def test_version_and_short_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"moestream {__version__}"
    assert PYPROJECT["project"]["version"] == __version__
    args = build_parser(["generate"]).parse_args(
        ["generate", "-m", "M", "-p", "hi", "-n", "7", "-c", "64", "-t", "3"]
    )
    assert (args.model_path, args.prompt, args.max_tokens, args.ctx_size, args.threads) == (
        "M",
        "hi",
        7,
        64,
        3,
    )
    args = build_parser(["serve"]).parse_args(
        ["serve", "-m", "M", "-c", "512", "-t", "2", "--log-level", "warning"]
    )
    assert (args.model_path, args.ctx_size, args.threads, args.log_level) == ("M", 512, 2, "warning")
    assert main(["generate", "-p", "hi"]) == 2 and "no checkpoint given" in capsys.readouterr().err
    assert (
        main(["generate", "A", "-m", "B", "-p", "hi"]) == 2
        and "name the checkpoint once" in capsys.readouterr().err
    )
