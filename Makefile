# Two set-up commands for a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all check lint format clean

# baft, and next to it the measurement harness (benchmarks/: package baft_bench behind
# `baft bench`) with the peer libraries it compares against
$(STAMP): pyproject.toml benchmarks/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]' -e 'benchmarks[peers]'
	$(BIN)/python tools/drop_broken_entry_points.py
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/baft demo

check: $(STAMP)
	$(BIN)/ruff check baft tests benchmarks examples
	$(BIN)/ruff format --check baft tests benchmarks examples
	$(BIN)/mypy baft benchmarks/baft_bench

test: check
	$(BIN)/pytest -q

test-all: check
	$(BIN)/pytest -q -m ''

format: $(STAMP)
	$(BIN)/ruff format baft tests benchmarks examples
	$(BIN)/ruff check --fix baft tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info benchmarks/build benchmarks/*.egg-info .pytest_cache .mypy_cache .ruff_cache
