# One-command workflows. `make demo`, `make verify` and `make test` set up .venv on first use
# (gradmerge with every extra: testbed, demo, hf, and the test tools).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch lies on disk on these machines; pin it so no multi-GB CUDA build is fetched.
TORCH ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# test-time oracles, installed without their declared dependencies (see pyproject's test extra):
# BackPACK and curvlinops declare torchvision (a CUDA torch); fusion-bench's method files need
# torch only (proofs_tests/oracles/test_fusion_bench.py), its package import Lightning, Hydra, ...
ORACLES ?= backpack-for-pytorch==1.7.1 curvlinops-for-pytorch==3.0.1 fusion-bench==0.2.33

.PHONY: setup demo tutorial verify test lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(FIND_LINKS) "$(TORCH)"
	$(BIN)/pip install -q $(FIND_LINKS) -e ".[test,testbed,demo,hf]"
	$(BIN)/pip install -q $(FIND_LINKS) --no-deps $(ORACLES)
	touch $@

demo: setup  ## the main job: merge and un-merge models on real data (runs/demo/: table, JSON, plots)
	$(BIN)/gradmerge demo --overwrite

tutorial: setup  ## docs/tutorial.md run as written: every block in order, in a fresh runs/tutorial
	rm -rf runs/tutorial
	$(BIN)/python docs/tutorial.py runs/tutorial

verify: setup  ## check every derivation of the appendix
	$(BIN)/gradmerge verify

test: setup  ## the whole test suite
	$(BIN)/pytest proofs_tests/

lint: setup  ## ruff (lint + format) and mypy on the public package
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache .mypy_cache *.egg-info
