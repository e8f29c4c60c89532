# Two entry points, both doing their own set-up on a fresh machine:
#   make demo   create .venv, install moestream, stream a synthetic MoE through a small cache
#   make test   same set-up, then ruff (lint + format check) and the test suite
#   make native build ggml's CPU backend for this CPU (AVX512/VNNI, dotprod, ...) from the llama-cpp-python
#               sdist; moestream then uses it instead of the prebuilt libggml-python (AVX2 / armv8.0).
#               CUDA=1 adds ggml's CUDA backend (nvcc needed), for this GPU or CUDA_ARCH (87: Jetson Orin).
#               `make setup` does this by itself where the prebuilt library leaves the CPU's features unused.
#
# Which torch: pyproject.toml leaves torch unpinned, so that GPU users keep their own build. `make setup`
# installs torch only into a .venv that has none: TORCH_SPEC (the CPU build) from a local wheel if pip is
# configured to find one (find-links), else from TORCH_INDEX, PyTorch's CPU-only index (plain PyPI would
# give the much larger CUDA build on Linux). GPU users: put your CUDA torch into .venv first, e.g.
#   python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128
# and `make setup` keeps it (or use the system's torch: make setup VENV_FLAGS=--system-site-packages).
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moestream-installed
SDIST_DIR := $(VENV)/ggml-sdist
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest-xdist workers for `make test` (whole test files to a worker, so module fixtures are built once;
# 0 runs the suite in this process)
TEST_WORKERS ?= 2

.PHONY: demo test setup native clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif $(PY) -m pip install -q --no-index --no-deps "$(TORCH_SPEC)" 2>/dev/null; then \
		echo "installed $(TORCH_SPEC) from a local wheel"; \
	else \
		echo "installing $(TORCH_SPEC), CPU build, from $(TORCH_INDEX)"; \
		$(PY) -m pip install -q "$(TORCH_SPEC)" --index-url "$(TORCH_INDEX)"; \
	fi
	@# the sdist that `make native` builds ggml from downloads while pip installs (a script of the standard
	@# library: nothing of moestream can be imported yet); where it is not needed it is left unused
	$(PY) moestream/ggml/sdist.py $(SDIST_DIR) > $(VENV)/sdist.log 2>&1 & fetch=$$!; \
		$(PY) -m pip install -q -e ".[test]"; status=$$?; wait $$fetch; exit $$status
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

clean:
	rm -rf $(VENV) .moestream build *.egg-info
