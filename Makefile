# Two commands for a fresh machine: `make lab` (open the course) and `make test`.
# `make check` is the one-minute smoke check to run before a workshop.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

# The lock: every package of the course's environment at an exact release (pip's -c), so
# a new release upstream changes nothing until someone moves it (`make lock`; `make
# latest` reports what the newest releases would change). PyTorch's release is read from it.
LOCK := constraints.txt
TORCH_VERSION := $(shell sed -n 's/^torch==//p' $(LOCK))
TORCH ?= torch==$(TORCH_VERSION)
# TORCH_INDEX chooses the wheel index for PyTorch only (the other packages come from
# pip's usual index). Empty, the default: pip's usual index (PyPI), which serves the
# CUDA build on Linux (several GB with its NVIDIA libraries), the Apple-silicon build on
# macOS and the CPU build on Windows. `cpu`: PyTorch's CPU-only wheels (about 190 MB),
# the right choice for a Linux machine without an NVIDIA GPU. Any other name (cu126,
# cu128, ...) picks that CUDA build; a full URL is used as given.
TORCH_INDEX ?=
TORCH_INDEX_BASE := https://download.pytorch.org/whl
torch_index_url = $(if $(findstring ://,$(TORCH_INDEX)),$(TORCH_INDEX),$(TORCH_INDEX_BASE)/$(strip $(TORCH_INDEX)))
# From PyTorch's index pip takes torch alone (--no-deps); its dependencies (sympy, jinja2,
# ...) come from pip's usual index in a second step, so an index that serves only PyTorch
# or a mirror without the rest works, and an unreachable index fails in seconds.
torch_pip_args = $(if $(strip $(TORCH_INDEX)),--index-url $(torch_index_url) --no-deps --retries 1 --timeout 20)
torch_default_note = pip's default index; on Linux that is the CUDA build, several GB: on a Linux machine without an NVIDIA GPU stop here (Ctrl-C) and run make $(or $(MAKECMDGOALS),lab) TORCH_INDEX=cpu
torch_from = $(if $(strip $(TORCH_INDEX)),$(strip $(TORCH_INDEX)) build from $(torch_index_url),$(torch_default_note))

# pip shows its own progress; PIPFLAGS=-q (as CI sets it) keeps only warnings and errors.
# (Not PIP_...: pip reads every PIP_* environment variable as one of its own options.)
PIPFLAGS ?=
PIP_UNLOCKED := $(BIN)/python -m pip install --disable-pip-version-check $(PIPFLAGS)
PIP := $(PIP_UNLOCKED) -c $(LOCK)

# JupyterLab: the port it tries first (it moves to the next free one if taken) and any
# extra arguments, e.g. LAB_ARGS=--no-browser on a machine without a browser or over SSH.
LAB_PORT ?= 8888
LAB_ARGS ?=
# The learner works in LAB_COPIES, git-ignored copies of notebooks/ made on first use and
# never overwritten (tools/learner_copies.py), so running, answering and saving never
# changes a tracked file and `git pull` cannot conflict with a learner's work.
LAB_COPIES := my-notebooks
LAB_NOTEBOOK := $(LAB_COPIES)/00_start_here.ipynb
# The layout the lab opens in: a JupyterLab workspace with the file browser in
# LAB_COPIES and LAB_NOTEBOOK open. Each `make lab` imports the committed file into
# LAB_WORKSPACES inside the virtual environment and opens /lab/workspaces/LAB_WORKSPACE;
# JupyterLab saves layout changes there, never into the repository. (A ?file-browser-path
# query on a /lab/tree URL cannot be used: the server appends ?token= to the URL it prints.)
LAB_WORKSPACE := accumlab
LAB_WORKSPACE_FILE := tools/lab-workspace.json
LAB_WORKSPACES := $(VENV)/lab-workspaces
# Quiet start: no Jupyter news pop-up or update check (tools/lab-overrides.json, copied into
# the environment's settings), no scan for language servers the course does not use
# (JupyterLab's "Skipped non-installed server(s)" line), and the build's accumlab.egg-info
# hidden from the file browser.
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings
LAB_HIDE := ['__pycache__','*.pyc','*.egg-info','.ipynb_checkpoints']

# Deterministic, headless runs for tests and notebook re-execution.
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0
TEST_ENV := TQDM_DISABLE=1 OMP_NUM_THREADS=1
NOTEBOOKS ?= $(sort $(wildcard notebooks/[0-9]*.ipynb))
# The test stages run pytest over TEST_JOBS worker processes, one a core (pytest-xdist):
# each test file and each notebook runs whole on one worker (its module fixtures made once,
# a notebook's cells in order in one kernel), the longest first (LONGEST_FIRST in
# tests/conftest.py), each worker taking the next file when it runs low, so both cores stay
# busy to the end. TEST_JOBS=0 runs everything in one process. Each run's log ends with
# where the time went (per worker, per directory, the slowest files) and the slowest tests.
TEST_JOBS ?= 2
PYTEST := env $(TEST_ENV) $(BIN)/python -m pytest -q -p no:cacheprovider \
  -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=20
# Each stage prints its name and wall time when it ends (tools/timed).
TIMED := tools/timed

.PHONY: lab restore check test unit nbval slow nbval-matrix lint notebooks bench bench-peers clean latest lock

$(BIN)/python:
	@echo "creating the virtual environment $(VENV) with $(PYTHON) ..."
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-torch: $(LOCK) | $(BIN)/python
	$(if $(strip $(TORCH_INDEX)),@$(BIN)/python tools/reach_index.py $(torch_index_url))
	@echo "installing PyTorch $(TORCH_VERSION) ($(torch_from)) ..."
	@$(TIMED) "install PyTorch" $(PIP) $(torch_pip_args) "$(TORCH)"
	$(if $(strip $(TORCH_INDEX)),@echo "installing PyTorch's dependencies from pip's usual index ...")
	$(if $(strip $(TORCH_INDEX)),$(PIP) "$(TORCH)")
	@touch $@

# The library (accumlab: PyTorch and tqdm) and the course beside it (accumlab-course, in
# course/: the models, data, widgets, plots, exercises and the `accumlab` command, with
# matplotlib and ipywidgets), both editable.
$(VENV)/.installed-core: pyproject.toml course/pyproject.toml $(VENV)/.installed-torch
	@echo "installing accumlab and the course (editable) with matplotlib, ipywidgets and tqdm ..."
	@$(TIMED) "install accumlab and the course" $(PIP) -e . -e ./course
	@touch $@

$(VENV)/.installed-lab: $(VENV)/.installed-core
	@echo "installing JupyterLab and Hugging Face transformers (lesson 08 runs a Trainer) ..."
	@$(TIMED) "install the lab" $(PIP) -e . -e "./course[lab]"
	@touch $@

# The test tools with the library and the course in one pip run (resolving the lock twice,
# once for the course and once for the tools, took about half a minute more); it stands for
# the course's install too, so `make test` installs once.
$(VENV)/.installed-dev: pyproject.toml course/pyproject.toml $(VENV)/.installed-torch
	@echo "installing accumlab and the course (editable) with the test tools (pytest, nbval, hypothesis, ruff) ..."
	@$(TIMED) "install accumlab, the course and the test tools" $(PIP) -e ".[dev]" -e ./course
	@touch $(VENV)/.installed-core $@

# Serve the repository root; the URL JupyterLab opens or prints (with its token) is the
# course's workspace: the learner's copies in the file browser, notebook 00 open.
lab: $(VENV)/.installed-lab
	@$(BIN)/python tools/learner_copies.py sync
	@mkdir -p $(LAB_SETTINGS) && cp tools/lab-overrides.json $(LAB_SETTINGS)/overrides.json
	$(BIN)/jupyter lab workspaces import --name=$(LAB_WORKSPACE) \
	  --LabWorkspaceImportApp.workspaces_dir=$(LAB_WORKSPACES) $(LAB_WORKSPACE_FILE)
	@echo "starting JupyterLab with $(LAB_NOTEBOOK) open. This terminal stays busy while it runs:"
	@echo "use a second terminal for make test or git. Ctrl-C twice here stops it ..."
	$(BIN)/jupyter lab --ServerApp.root_dir=. --ServerApp.port=$(LAB_PORT) \
	  --LabApp.workspaces_dir=$(LAB_WORKSPACES) \
	  --LabApp.default_url=/lab/workspaces/$(LAB_WORKSPACE) \
	  --LanguageServerManager.autodetect=False \
	  "--ContentsManager.hide_globs=$(LAB_HIDE)" \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# A fresh copy of one lesson (NB=03) or of all (NB=all) in $(LAB_COPIES); the replaced
# copy is saved in $(LAB_COPIES)/backups/ under a name no file has, and the line printed
# says so.
restore:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) tools/learner_copies.py restore $(NB)

check: $(VENV)/.installed-core
	@$(TIMED) "smoke check" $(BIN)/accumlab env --check

# Older transformers releases beside the lock's, for tests/hf/test_hf_audit_versions.py
# (each Trainer counted num_items_in_batch its own way): 4.46.3 (the first with the count),
# 4.50.3 and 4.57.6, each installed into its own folder with --no-deps and exact releases
# of what it needs (huggingface_hub and tokenizers in the ranges that release declares;
# datasets 4.0.0: the Trainer imports datasets, and the environment's needs
# huggingface_hub 1.x), never into the environment; only the tests put a folder on
# PYTHONPATH, in a subprocess. accumlab.hf.TESTED_TRANSFORMERS is these and the lock's.
HF_OLD := 4.46.3 4.50.3 4.57.6
HF_PINS_4.46.3 := "huggingface_hub==0.36.2" "tokenizers==0.20.3"
HF_PINS_4.50.3 := "huggingface_hub==0.36.2" "tokenizers==0.21.4"
HF_PINS_4.57.6 := "huggingface_hub==0.36.2" "tokenizers==0.22.2"
HF_OLD_INSTALLED := $(foreach v,$(HF_OLD),$(VENV)/hf-transformers-$(v)/.installed)
$(VENV)/hf-transformers-%/.installed: | $(VENV)/.installed-dev
	@echo "installing transformers $* into $(@D) for the transformers-version test ..."
	@$(TIMED) "install transformers $*" $(PIP_UNLOCKED) --no-deps --target $(@D) "transformers==$*" $(HF_PINS_$*) "datasets==4.0.0"
	@touch $@

lint: $(VENV)/.installed-dev
	@$(TIMED) lint $(BIN)/ruff check .

# The unit tests but the slow tier (tests marked slow: each release of transformers beside
# the lock's, the wheel and fresh environments, the site build). `make slow` runs that
# tier; .ci/run runs it after `make test`.
unit: $(VENV)/.installed-dev
	@$(TIMED) "unit tests" $(PYTEST) -m "not slow" tests

slow: $(VENV)/.installed-dev $(HF_OLD_INSTALLED)
	@$(TIMED) "slow tests" $(PYTEST) -m slow tests

nbval: $(VENV)/.installed-dev
	@$(TIMED) "notebooks (strict nbval)" $(PYTEST) --nbval $(NOTEBOOKS)

# The unit tests and the notebooks in one session, over both cores (see TEST_JOBS). The
# test tools first: their install is the course's too, so check finds it done.
test: $(VENV)/.installed-dev check lint
	@echo "running the unit tests and the notebooks under strict nbval on $(TEST_JOBS) workers ..."
	@$(TIMED) "unit tests and notebooks" $(PYTEST) -m "not slow" --nbval tests $(NOTEBOOKS)

# Strict nbval under several CPU kernel choices (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
# thread count): lists every cell whose output depends on them. Run it before committing
# re-executed notebooks (CONTRIBUTING.md); MATRIX=full for all 8 combinations.
MATRIX ?= pairs
nbval-matrix: $(VENV)/.installed-dev
	$(BIN)/python tools/nbval_matrix.py --matrix $(MATRIX) $(NOTEBOOKS)

# Re-execute and save notebooks the way nbval sees them (NOTEBOOKS=notebooks/02_*.ipynb for one).
notebooks: $(VENV)/.installed-dev
	$(TEST_ENV) $(BIN)/python tools/run_notebooks.py $(NOTEBOOKS)

# The course as a static HTML book in site/ (git-ignored), from the committed notebooks
# without running them; Sphinx warnings are errors. Then tools/check_site.py checks it:
# every lesson has a page, every image and local link resolves, math, downloads, alt
# text, the API reference and the exercise index are complete. Open site/index.html.
# Nothing is executed, so the site needs no GPU build of PyTorch (autodoc imports
# accumlab, which imports torch): where no PyTorch is installed yet, `make site` takes the
# CPU build (about 190 MB) instead of pip's default, the multi-GB CUDA build on Linux. An
# installed PyTorch is kept; TORCH_INDEX on the command line or in the environment wins.
.PHONY: site
site: TORCH_INDEX := $(if $(filter environment command line,$(origin TORCH_INDEX)),$(TORCH_INDEX),cpu)
$(VENV)/.installed-site: $(VENV)/.installed-core
	@echo "installing the site tools (Sphinx, myst-nb, sphinx-book-theme, MathJax, copy buttons) ..."
	@$(TIMED) "install the site tools" $(PIP) -e ".[site]" -e ./course
	@touch $@

site: $(VENV)/.installed-site
	$(BIN)/python tools/build_site.py
	$(BIN)/python tools/check_site.py

# Ratios measured side by side in one run; see benchmarks/README.md.
bench: $(VENV)/.installed-dev
	for b in loop_overhead precision_cost memory_peak ddp_no_sync loss_memory fsdp2_sync chunked_loss hf_audit_cost; do \
	  $(TEST_ENV) $(BIN)/python benchmarks/$$b.py || exit 1; done

# accumlab beside Hugging Face Accelerate: installs the optional `peers` extra first.
bench-peers: $(VENV)/.installed-dev
	@echo "installing Hugging Face Accelerate (the peers extra) ..."
	$(PIP) -e ".[peers]"
	$(TEST_ENV) $(BIN)/python benchmarks/peers.py

# The newest release of every package (PyTorch kept at the lock's) in $(VENV)-latest: which
# releases differ from the lock, and which of the integrations' tests and lessons fail
# under them. A report: it changes nothing and exits 0 whatever the tests say.
latest:
	$(PYTHON) tools/lock.py latest --venv $(VENV)-latest

# Rewrite the lock from a fresh resolution (the newest releases; PINS="transformers==5.25.0"
# keeps some where you say). Then make test, make notebooks where an output moved.
lock:
	$(PYTHON) tools/lock.py write $(PINS)

clean:
	rm -rf $(VENV) $(VENV)-latest .pytest_cache .ruff_cache .hypothesis
