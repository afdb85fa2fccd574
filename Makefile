# `make demo` and `make test` set everything up in .venv (torch 2.13.0 CPU build first if missing).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# The oldest torch shardopt supports (setup.cfg), PyPI's build; its own venv, for `make test-floor`.
FLOOR_VENV  ?= .venv-floor
FLOOR_TORCH ?= torch==2.9.1

.PHONY: setup demo lint test test-fast test-floor docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test,hf,lightning,ft]'
	@touch $@

demo: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_gpt.py

lint: setup  # the layers (lint-imports: an upward import between folders or an import circle fails, setup.cfg),
	# ruff's rules and mypy's types (both configured in pyproject.toml)
	$(VENV)/bin/lint-imports --no-logo
	$(VENV)/bin/ruff check shardopt tests
	$(VENV)/bin/mypy shardopt

test: lint  # the lint first; then the unit tier on both cores, then the tiers that start processes of their own, one at a time
	$(PY) -m pytest -q -m unit -n 2
	$(PY) -m pytest -q -m "not unit"

test-fast: setup  # the layers (lint-imports), then the unit tier but its compiles of the fused kernels: under a minute
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest -q -m "unit and not compile" -n 2

test-floor:  # the unit tier on the floor torch (a 1.4 GB download the first time: PyPI's torch is a CUDA build)
	@test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	@$(FLOOR_VENV)/bin/python -m pip install -q "$(FLOOR_TORCH)" -e '.[test,hf,lightning]'
	$(FLOOR_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(FLOOR_VENV)/bin/lint-imports --no-logo
	$(FLOOR_VENV)/bin/mypy shardopt  # the types against torch 2.9's stubs (its ignores too: warn_unused_ignores)
	$(FLOOR_VENV)/bin/python -m pytest -q -m unit -n 2 -p no:cacheprovider

docs: setup  # the site in site/, strict: a broken link, anchor or page fails
	@$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PY) -m pip install -q -e '.[docs]'
	$(PY) benchmarks/report.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(FLOOR_VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache site
