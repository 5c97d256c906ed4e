# Two commands do all set-up on a fresh machine:  make lab  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
MODEL := src/helpers/assets/tiny-japanese-bert
NOTEBOOKS := $(shell PYTHONPATH=src $(PYTHON) -c "from pathlib import Path; from helpers.checks.notebook_env import lessons_then_solutions as s; print(*s(Path('notebooks')))")

# Stored notebook outputs must not depend on progress bars, hub look-ups or a data limit: one definition, in
# src/helpers/checks/notebook_env.py (pytest's conftest.py and gpu-check read the same; it needs no torch).
NB_ENV := $(shell PYTHONPATH=src $(PYTHON) -m helpers.checks.notebook_env)
# The stored outputs are a one-thread CPU's: `make notebooks` makes them and `make test` compares them with every GPU
# hidden and one thread per process (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1, also set by conftest.py), on any
# machine; `make gpu-check` runs the notebooks on the GPUs.
CPU_NB_ENV := $(shell PYTHONPATH=src $(PYTHON) -m helpers.checks.notebook_env --cpu)
NBVAL := --nbval --nbval-current-env
# make test NB=03  (or NB="03 solutions/03", or a path): those notebooks only, under nbval, without the unit tests
NB_FILES := $(foreach nb,$(NB),$(or $(wildcard $(nb)),$(wildcard notebooks/$(nb)*.ipynb),$(error NB=$(nb): no notebook notebooks/$(nb)*.ipynb)))

# Install options, used when .venv is first built (on a fresh checkout or after `make clean`):
#   TORCH=auto      (default) Linux without an NVIDIA driver: torch's CPU-only build from PyTorch's CPU wheel
#                   index; elsewhere, or when that index cannot be reached: the pinned torch from your package
#                   index (PyPI's Linux torch is the CUDA build, several GB with its nvidia-* wheels)
#   TORCH=cpu | TORCH=pypi   force either build; an existing .venv with the other one is refused
#   TORCH_CPU_INDEX=URL      a mirror of PyTorch's CPU wheel index
#   WHEELHOUSE=DIR  install only from what `make wheelhouse` saved in DIR, without network
TORCH ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_BUILD = $(PYTHON) tools/torch_build.py --torch $(TORCH) --cpu-index $(TORCH_CPU_INDEX)
PIP_SOURCE := $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE))

.PHONY: lab venv venv-check test unit prose notebooks torch-range slurm-check tiny-model docs bench stress wheelhouse gpu-check \
	memory-chart clean

# Jupyter refuses to start as root (containers, CI images) unless told so. It opens on 00_setup.ipynb (what
# WORKSHOP.md runs first), with the lab settings of jupyter-config/ (no news prompt) as defaults under the user's own.
# LAB_ARGS adds options, e.g. the browser test's port and token: make lab LAB_ARGS="--no-browser --port=8899"
lab: venv-check $(STAMP)
	JUPYTER_CONFIG_PATH=$(CURDIR)/jupyter-config$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH)) \
	  $(BIN)/jupyter lab notebooks --LabApp.default_url=/lab/tree/00_setup.ipynb $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# Build .venv without starting anything (then: . .venv/bin/activate, or run .venv/bin/python ...).
venv: venv-check $(STAMP)

# Say so when an existing .venv holds another torch build than the one TORCH (or this machine) asks for.
venv-check:
	@$(TORCH_BUILD) check $(BIN)/python

# make test runs the whole suite in WORKERS processes (pytest-xdist; default 2, the cores CI has), each taking a whole
# file at a time (conftest.py): a notebook's cells run in order in one kernel. Every process computes with one thread,
# so two workers share 2 cores without stalling each other. WORKERS=0: one process. NB= runs use one process.
WORKERS ?= $(if $(NB),0,2)
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS))

# Ends with one line saying what it compared, and that it ran with the GPUs hidden where there are any (conftest.py).
test: venv-check $(if $(NB),$(STAMP),$(DEV_STAMP))
	$(CPU_NB_ENV) $(BIN)/python -m pytest $(XDIST) $(if $(NB),$(NBVAL) $(NB_FILES),tests $(NBVAL) notebooks --durations=20)

unit: venv-check $(DEV_STAMP)
	$(CPU_NB_ENV) $(BIN)/python -m pytest tests

# The notebooks' Japanese prose: textlint (versions in package-lock.json, rules in .textlintrc.json, terms in
# glossary.yml; `npm ci` installs it the first time) and each lesson's size. Without Node.js: one line, sizes only.
prose: $(STAMP)
	$(BIN)/python -m helpers.checks.prose

# Re-execute every notebook top to bottom, in place, so committed outputs are the code's own (a CPU's, GPUs hidden).
# The second pass merges stream chunks, whose split depends on timing, so re-runs give identical files.
notebooks: $(STAMP)
	for nb in $(NOTEBOOKS); do \
	  $(CPU_NB_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	  $(BIN)/jupyter nbconvert --to notebook --inplace --coalesce-streams "$$nb" || exit 1; \
	done

# The static site, from the notebooks' stored outputs (nothing is re-executed): open build/site/index.html
# Outputs of notebooks executed on a GPU (folders in docs/gpu-runs/, written by gpu-check --keep) show in tabs beside
# the stored ones: every folder there by default, GPU_RUNS="DIR1 DIR2" to choose, GPU_RUNS= for none.
docs: $(DEV_STAMP)
	$(BIN)/python docs/build.py build/site $(if $(filter undefined,$(origin GPU_RUNS)),,--gpu-runs $(GPU_RUNS))

# Every notebook executed under another torch release, everything else at its pins (outputs not compared; an error
# outside a raises-exception cell fails): make torch-range TORCH_VERSION=2.10.0. Its venv goes outside the repository,
# into TORCH_VENVS/<version> (PyPI's torch is the CUDA build: 5 to 8 GB each; delete those you no longer need).
TORCH_VENVS ?= $(abspath $(CURDIR)/../torchvenvs)
TORCH_VENV = $(TORCH_VENVS)/$(TORCH_VERSION)
ifneq ($(filter torch-range,$(MAKECMDGOALS)),)
ifeq ($(TORCH_VERSION),)
$(error make torch-range TORCH_VERSION=X.Y.Z: which torch release to run the notebooks under (README, 'Which torch'))
endif
endif
torch-range: $(TORCH_VENV)/.installed
	$(CPU_NB_ENV) PYTHONPATH=$(CURDIR)/src $(TORCH_VENV)/bin/python -m helpers.checks.torch_range $(TORCH_RANGE_ARGS)

$(TORCH_VENVS)/%/.installed: requirements.txt
	@$(PYTHON) tools/venv_ready.py $(TORCH_VENVS)/$*
	test -d $(TORCH_VENVS)/$* || $(PYTHON) -m venv $(TORCH_VENVS)/$*
	grep -v '^torch==' requirements.txt > $(TORCH_VENVS)/$*/requirements.txt
	$(TORCH_VENVS)/$*/bin/python -m pip install --quiet torch==$* -r $(TORCH_VENVS)/$*/requirements.txt
	touch $@

# A real Slurm on this machine (root; installs Debian's slurm-wlm and munge where missing): two nodes in network
# namespaces run examples/slurm/finetune-cpu.sbatch, preempted twice, checked bitwise against one machine. ~3 minutes.
slurm-check: $(STAMP)
	$(BIN)/python -m helpers.checks.slurm_check

# Side-by-side timings; writes benchmarks/results.md and the table in CONTRIBUTING.md. BENCH_ARGS="--repeats 5"
bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

# Start every multi-process entry point N times in a row (2 processes on the CPU) and count the runs that did not exit
# 0, per entry point: an abort at exit or a hang shows here, not in one test run. N=50 takes hours on 2 cores.
# STRESS_ARGS="--only lever_checks --keep failed-runs" for one entry point, keeping the output of failed runs.
N ?= 10
stress: $(STAMP)
	$(NB_ENV) $(BIN)/python benchmarks/exit_stress.py --runs $(N) $(STRESS_ARGS)

# Rebuild the bundled offline model (committed; CONTRIBUTING.md says why). About a minute on 2 cores.
# Rebuilds the bundled model; downloads the pinned ja-ginza wheel (59 MB, chiVe's word vectors) once into
# ~/.cache/helpers-build/ (CACHE=... to change), checked by SHA-256. Nothing it needs joins requirements.txt.
CACHE ?= $(HOME)/.cache/helpers-build
tiny-model: $(STAMP)
	$(BIN)/python -m helpers.build.tiny_bert $(MODEL) --cache $(CACHE)

# Download every pinned package, dev tools included (make test, make docs, make bench), and setuptools and wheel
# (to build the package and the two sdists) into wheelhouse/, for a later `make lab WHEELHOUSE=wheelhouse` (or
# test, docs) on a machine of the same OS, CPU and Python without network. TORCH picks the torch build as above.
wheelhouse:
	$(TORCH_BUILD) download wheelhouse
	$(PYTHON) -m pip download --quiet --find-links wheelhouse -d wheelhouse -r requirements.txt -r requirements-dev.txt \
	  "setuptools>=68" wheel
	du -sh wheelhouse

# On a CUDA machine: memory predictions vs torch.cuda.max_memory_allocated, DDP over NCCL and kill-and-resume
# (--deterministic, bitwise), every notebook executed (GPU cells active) into a scratch folder. One report, also
# as JSON with GPU_CHECK_ARGS="--json gpu-check.json"; exit 1 on a failure. Without CUDA: one line, exit 0.
gpu-check: $(STAMP)
	$(NB_ENV) $(BIN)/python -m helpers.checks.gpu_check $(GPU_CHECK_ARGS)

# Regenerate the README's per-GPU memory chart from the memory model (python -m helpers.memory --help: your setting).
memory-chart: $(STAMP)
	$(BIN)/python -m helpers.memory.charts docs/img/per_device_memory.png

# venv_ready.py stops, naming the package to install, where `python3 -m venv` cannot work (Debian and Ubuntu ship
# ensurepip apart, in python3-venv), and removes a .venv that an earlier such failure left without pip.
$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) tools/venv_ready.py $(VENV)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(TORCH_BUILD) install $(BIN)/python $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE))
	$(BIN)/python -m pip install --quiet $(PIP_SOURCE) -r requirements.txt
	$(BIN)/python -m pip install --quiet $(PIP_SOURCE) --no-deps -e .
	touch $@

# Tools for the site, the browser test and the benchmarks; `make lab` does without them.
$(DEV_STAMP): requirements-dev.txt $(STAMP)
	$(BIN)/python -m pip install --quiet $(PIP_SOURCE) -r requirements-dev.txt
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
