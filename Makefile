# Two commands for a fresh machine: `make lab` (open the course) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of PyTorch 2.13.0; set TORCH to another pin for a GPU machine.
TORCH  ?= torch==2.13.0
# Deterministic, headless runs for tests and notebook re-execution.
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0
TEST_ENV := TQDM_DISABLE=1 OMP_NUM_THREADS=1
NOTEBOOKS ?= $(sort $(wildcard notebooks/[0-9]*.ipynb))

.PHONY: lab test unit nbval lint notebooks bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

$(VENV)/.installed-lab: $(VENV)/.installed-dev
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev,lab]"
	touch $@

lab: $(VENV)/.installed-lab
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/00_start_here.ipynb

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

unit: $(VENV)/.installed-dev
	$(TEST_ENV) $(BIN)/python -m pytest -q tests

nbval: $(VENV)/.installed-dev
	$(TEST_ENV) $(BIN)/python -m pytest -q -p no:cacheprovider --nbval $(NOTEBOOKS)

test: lint unit nbval

# Re-execute and save notebooks the way nbval sees them (NOTEBOOKS=notebooks/02_*.ipynb for one).
notebooks: $(VENV)/.installed-dev
	$(TEST_ENV) $(BIN)/python tools/run_notebooks.py $(NOTEBOOKS)

# Ratios measured side by side in one run; see benchmarks/README.md.
bench: $(VENV)/.installed-dev
	for b in loop_overhead precision_cost memory_peak ddp_no_sync loss_memory; do \
	  $(TEST_ENV) $(BIN)/python benchmarks/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
