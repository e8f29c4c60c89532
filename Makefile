# Two entry points, both doing their own set-up on a fresh machine:
#   make demo   create .venv, install moestream, stream a synthetic MoE through a small cache
#   make test   same set-up, then ruff (lint + format check) and the test suite
#   make native build ggml's CPU backend for this CPU (AVX512/VNNI, dotprod, ...) from the llama-cpp-python
#               sdist; moestream then uses it instead of the prebuilt libggml-python (AVX2 / armv8.0).
#               CUDA=1 adds ggml's CUDA backend (nvcc needed), for this GPU or CUDA_ARCH (87: Jetson Orin).
#               `make setup` does this by itself where the prebuilt library leaves the CPU's features unused.
# and for whoever changes the dependencies (none of these runs in CI):
#   make lock         refresh requirements/test.lock (uv pip compile) after pyproject.toml or
#                     requirements/test.in changed; pins already in the lock are kept
#                     (make lock UPGRADE=1: every package at its newest release)
#   make test-latest  the suite in .venv-latest against the newest releases that the ranges allow
#   make test-oldest  the suite in .venv-oldest against the oldest releases that the ranges allow
#
# The lock: `make setup` installs every package, transitive ones, pip and the build backend included, at
# the version requirements/test.lock names (pip constraints), so that a release elsewhere cannot change
# what `make test` runs; `pip install moestream` keeps pyproject.toml's ranges. The lock is resolved for
# CI's machine (Linux x86-64, the python3 on PATH) with torch's CPU build (no nvidia-* packages).
#
# Which torch: pyproject.toml leaves torch unpinned, so that GPU users keep their own build. `make setup`
# installs torch only into a .venv that has none: the lock's version (TORCH_SPEC), CPU build, from a local
# wheel if pip is configured to find one (find-links), else from TORCH_INDEX, PyTorch's CPU-only index
# (plain PyPI would give the much larger CUDA build on Linux). GPU users: put your CUDA torch into .venv
# first, e.g.
#   python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128
# and `make setup` keeps it, and the lock's other versions (or use the system's torch: make setup
# VENV_FLAGS=--system-site-packages).
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moestream-installed
SDIST_DIR := $(VENV)/ggml-sdist
# the exact versions `make setup` installs (empty: the newest releases that pyproject.toml allows)
LOCK ?= requirements/test.lock
# torch's CPU build at the lock's version (empty: pip installs torch with the other packages)
TORCH_SPEC ?= $(if $(LOCK),$(shell sed -n 's/^\(torch==[^ ]*\).*/\1/p' $(LOCK)))
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest-xdist workers for `make test` (whole test files to a worker, so module fixtures are built once;
# 0 runs the suite in this process)
TEST_WORKERS ?= 2
# uv, in a venv of its own, resolves the lock (`make lock`) and the oldest versions (`make test-oldest`)
UV_SPEC ?= uv==0.13.9
UV_VENV := .venv-uv
UV := $(UV_VENV)/bin/uv
UPGRADE ?=

.PHONY: demo test setup native clean lock test-latest test-oldest

setup: $(STAMP)

# pip and the build backend (setuptools) at the lock's versions too: moestream is built in this venv
# (--no-build-isolation), not with whatever setuptools PyPI has that day. The other packages are
# installed with the lock as constraints, its torch line replaced by the torch the venv holds
$(STAMP): pyproject.toml $(LOCK)
	python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade $(if $(LOCK),-c $(LOCK)) pip setuptools
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ -z "$(TORCH_SPEC)" ]; then \
		echo "torch is installed with the other packages"; \
	elif $(PY) -m pip install -q --no-index --no-deps "$(TORCH_SPEC)" 2>/dev/null; then \
		echo "installed $(TORCH_SPEC) from a local wheel"; \
	else \
		echo "installing $(TORCH_SPEC), CPU build, from $(TORCH_INDEX)"; \
		$(PY) -m pip install -q "$(TORCH_SPEC)" --index-url "$(TORCH_INDEX)"; \
	fi
	@rm -f $(VENV)/constraints.txt
	@if [ -n "$(LOCK)" ]; then \
		sed '/^torch==/d' $(LOCK) > $(VENV)/constraints.txt; \
		$(PY) -c "import torch; print('torch==' + torch.__version__)" >> $(VENV)/constraints.txt 2>/dev/null \
			|| grep '^torch==' $(LOCK) >> $(VENV)/constraints.txt; \
	fi
	@# the sdist that `make native` builds ggml from downloads while pip installs (a script of the standard
	@# library: nothing of moestream can be imported yet); where it is not needed it is left unused
	$(PY) moestream/ggml/sdist.py $(SDIST_DIR) > $(VENV)/sdist.log 2>&1 & fetch=$$!; \
		$(PY) -m pip install -q --no-build-isolation $(if $(LOCK),-c $(VENV)/constraints.txt) -e ".[test]"; \
		status=$$?; wait $$fetch; exit $$status
	@# ggml's kernels for this CPU where the prebuilt ones leave its features unused (AVX512, VNNI, ...);
	@# a failed build keeps the prebuilt library, which the mode line then names with what it leaves unused
	$(PY) -m moestream.ggml.build --if-needed --sdist-dir $(SDIST_DIR) || echo "make setup: the native ggml build failed; using the prebuilt library"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moestream demo

test: $(STAMP)
	$(VENV)/bin/ruff check moestream tests benchmarks
	$(VENV)/bin/ruff format --check moestream tests benchmarks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# make native CUDA=1 [CUDA_ARCH=87]: also ggml's CUDA backend, for this machine's GPU or the named architecture
native: $(STAMP)
	$(PY) -m moestream.ggml.build --sdist-dir $(SDIST_DIR) $(if $(CUDA),--cuda) $(if $(CUDA_ARCH),--cuda-arch $(CUDA_ARCH))

$(UV):
	python3 -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q "$(UV_SPEC)"

# The lock from pyproject.toml's test extra and requirements/test.in (torch's CPU build, pip, the build
# backend). uv reads no pip configuration: it is handed the torch CPU wheel that pip finds (a local wheel
# through pip's find-links, else PyTorch's CPU index) and takes everything else from PyPI
lock: $(UV)
	rm -rf $(UV_VENV)/torch
	spec=$$(sed -n 's/^\(torch==[^ ]*\).*/\1/p' requirements/test.in); \
		python3 -m pip download -q --no-deps --no-index -d $(UV_VENV)/torch "$$spec" 2>/dev/null \
		|| python3 -m pip download -q --no-deps -d $(UV_VENV)/torch "$$spec" --index-url "$(TORCH_INDEX)"
	$(UV) pip compile -q pyproject.toml --extra test requirements/test.in $(if $(UPGRADE),--upgrade) \
		--find-links $(UV_VENV)/torch --python python3 --custom-compile-command "make lock" \
		--output-file requirements/test.lock
	@echo "requirements/test.lock: $$(grep -c '^[a-z]' requirements/test.lock) packages; make test installs them"

# the newest releases: a fresh .venv-latest every time, no lock; torch is the newest CPU build that pip
# finds (a CUDA build from PyPI would bring a triton other than the test extra's pin)
test-latest:
	rm -rf .venv-latest
	$(MAKE) test VENV=.venv-latest LOCK= TORCH_SPEC=torch

# the oldest releases that pyproject.toml allows for every direct dependency (uv's lowest-direct
# resolution; transitive ones at their newest), with requirements/oldest-overrides.txt winning over what
# those ask for (pip cannot override: the resolution is installed as it is, --no-deps)
test-oldest: $(UV)
	rm -rf .venv-oldest && python3 -m venv .venv-oldest
	$(UV) pip compile -q pyproject.toml --extra test --resolution lowest-direct --python python3 \
		--override requirements/oldest-overrides.txt --output-file .venv-oldest/oldest.txt
	.venv-oldest/bin/python -m pip install -q --no-deps -r .venv-oldest/oldest.txt
	.venv-oldest/bin/python -m pip install -q --no-deps -e .
	touch .venv-oldest/.moestream-installed
	$(MAKE) test VENV=.venv-oldest LOCK=.venv-oldest/oldest.txt

clean:
	rm -rf $(VENV) .venv-latest .venv-oldest $(UV_VENV) .moestream build *.egg-info
