# One-command workflows. Each target sets up .venv with what it needs on first use, and says at
# which step it is (pip prints what it collects and installs; nothing is silenced):
#   make demo     torch (the CPU wheel), then gradmerge with its [demo] extra: nothing else
#   make verify   + the [testbed] extra (sympy)
#   make test, make lint   + every extra, the test tools and the oracles (pyproject's [test])
# Each step leaves a stamp file in .venv, so `make demo` then `make test` installs only what is
# missing, and a fresh clone runs any target on its own.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check
# The CPU wheel of torch lies on disk on these machines; pin it so no multi-GB CUDA build is fetched.
TORCH ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# test-time oracles, installed without their declared dependencies (see pyproject's test extra):
# BackPACK and curvlinops declare torchvision (a CUDA torch); fusion-bench's method files need
# torch only (proofs_tests/oracles/test_fusion_bench.py), its package import Lightning, Hydra, ...
ORACLES ?= backpack-for-pytorch==1.7.1 curvlinops-for-pytorch==3.0.1 fusion-bench==0.2.33

.PHONY: setup setup-demo setup-testbed setup-hf demo tutorial verify test lint format clean

setup: $(VENV)/.test        ## everything: what `make test` and `make lint` use
setup-demo: $(VENV)/.demo
setup-testbed: $(VENV)/.testbed
setup-hf: $(VENV)/.hf

$(VENV)/.torch:
	@echo "==> [set-up 1] a virtual environment in $(VENV), then $(TORCH) (the CPU wheel)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(FIND_LINKS) "$(TORCH)"
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	@echo "==> [set-up 2] gradmerge with the demo's extra: scikit-learn, matplotlib, scipy"
	$(PIP) install $(FIND_LINKS) -e ".[demo]"
	touch $@

$(VENV)/.testbed: $(VENV)/.torch pyproject.toml
	@echo "==> [set-up 2] gradmerge with the testbed's extra: sympy"
	$(PIP) install $(FIND_LINKS) -e ".[testbed]"
	touch $@

$(VENV)/.hf: $(VENV)/.torch pyproject.toml
	@echo "==> [set-up 2] gradmerge with the Hugging Face extra: transformers, tokenizers"
	$(PIP) install $(FIND_LINKS) -e ".[hf]"
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	@echo "==> [set-up 2] gradmerge with every extra and the test tools (pyproject's [test])"
	$(PIP) install $(FIND_LINKS) -e ".[test,testbed,demo,hf]"
	@echo "==> [set-up 3] the test oracles, without their declared dependencies: $(ORACLES)"
	$(PIP) install $(FIND_LINKS) --no-deps $(ORACLES)
	touch $@ $(VENV)/.demo $(VENV)/.testbed $(VENV)/.hf

demo: $(VENV)/.demo  ## the main job: merge and un-merge models on real data (runs/demo/: table, JSON, plots)
	@echo "==> gradmerge demo --overwrite"
	$(BIN)/gradmerge demo --overwrite

tutorial: $(VENV)/.hf  ## docs/tutorial.md run as written: every block in order, in a fresh runs/tutorial
	rm -rf runs/tutorial
	$(BIN)/python docs/tutorial.py runs/tutorial

verify: $(VENV)/.testbed  ## check every derivation of the appendix
	$(BIN)/gradmerge verify

test: $(VENV)/.test  ## the whole test suite
	$(BIN)/pytest proofs_tests/

lint: $(VENV)/.test  ## ruff (lint + format) and mypy on the public package
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(VENV)/.test
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache .mypy_cache *.egg-info
