# One entry point for setup, the main job, tests and benchmarks. Every target sets up the
# environment it needs, so `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export EMBED_DATA_DIR ?= $(abspath ../shared/data)
export EMBED_CACHE_DIR ?= $(abspath .cache/embed_lib)
TASK ?= stsb

.PHONY: venv run baseline test test-slow bench clean

venv: $(STAMP)
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# the CPU build of torch first, from local disk: letting pip resolve torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

## main job: for now the frozen-baseline evaluation of all four tasks
run: venv
	$(BIN)/python -m embed_lib baseline --task all

baseline: venv
	$(BIN)/python -m embed_lib baseline --task $(TASK)

test: venv
	$(BIN)/python -m pytest -q

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

bench: venv
	$(BIN)/python benchmarks/encode_throughput.py
	$(BIN)/python benchmarks/baseline_cache.py

clean:
	rm -rf .cache benchmarks/out
