# Two entry points, both doing their own set-up on a fresh machine:
#   make demo   create .venv, install moestream, stream a synthetic MoE through a small cache
#   make test   same set-up, then ruff (lint + format check) and the test suite
#   make native build ggml's CPU backend for this CPU (AVX512/VNNI, dotprod, ...) from the llama-cpp-python
#               sdist; moestream then uses it instead of the prebuilt libggml-python (AVX2 / armv8.0)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moestream-installed
# The CPU build of torch is pinned here, not in pyproject: GPU users bring their own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test setup native clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moestream demo

test: $(STAMP)
	$(VENV)/bin/ruff check moestream tests benchmarks
	$(VENV)/bin/ruff format --check moestream tests benchmarks
	$(PY) -m pytest -q

native: $(STAMP)
	$(PY) -m moestream.ggml.build

clean:
	rm -rf $(VENV) .moestream build *.egg-info
