"""Download the llama-cpp-python sdist whose vendored llama.cpp `make native` builds ggml from.

Standard library only, so that `make setup` can run it as a script (`python moestream/ggml/sdist.py
DIR`) while pip installs moestream's dependencies, before anything of moestream can be imported.
"""

from __future__ import annotations

import os
import sys

# run as a script, this folder leads sys.path, and its types.py would shadow the standard library's
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import subprocess
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"


def download(folder: Path, log=None) -> Path:
    """The sdist's archive in `folder`, downloaded by pip unless it is there. Only this package is taken
    as source: pip prepares its metadata, and `--no-binary :all:` would build its build dependencies
    (scikit-build-core, hatchling, ...) from source too (59 s against 15 s on a 2-core machine)."""
    archive = folder / ARCHIVE
    if archive.exists():
        return archive
    folder.mkdir(parents=True, exist_ok=True)
    name = SDIST.split("==")[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, SDIST]
    cmd += ["-d", str(folder)]
    print("+ " + " ".join(cmd), file=log or sys.stdout, flush=True)
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    if done.returncode or not archive.exists():
        raise SystemExit(f"make native: pip download of {SDIST} failed ({done.returncode})")
    return archive


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python moestream/ggml/sdist.py DIR")
    print(download(Path(sys.argv[1])))
