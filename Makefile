# Two commands do all set-up on a fresh machine:  make lab  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
MODEL := src/helpers/assets/tiny-japanese-bert
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb)) $(sort $(wildcard notebooks/solutions/*.ipynb))

# Stored notebook outputs must not depend on progress bars or hub look-ups.
NB_ENV := TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
NBVAL := --nbval --nbval-current-env

# Install options, used when .venv is first built (on a fresh checkout or after `make clean`):
#   TORCH=cpu       torch's CPU-only build from PyTorch's wheel index first (Linux without an NVIDIA GPU:
#                   PyPI's Linux torch is the CUDA build, several GB with its nvidia-* wheels)
#   WHEELHOUSE=DIR  install only from what `make wheelhouse` saved in DIR, without network
TORCH_PIN := $(shell grep '^torch==' requirements.txt)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PIP_SOURCE := $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE))

.PHONY: lab test unit notebooks tiny-model docs bench wheelhouse gpu-check memory-chart clean

# Jupyter refuses to start as root (containers, CI images) unless told so.
# LAB_ARGS adds options, e.g. the browser test's port and token: make lab LAB_ARGS="--no-browser --port=8899"
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

test: $(DEV_STAMP)
	$(NB_ENV) $(BIN)/python -m pytest tests $(NBVAL) notebooks --durations=20

unit: $(DEV_STAMP)
	$(BIN)/python -m pytest tests

# Re-execute every notebook top to bottom, in place, so committed outputs are the code's own.
# The second pass merges stream chunks, whose split depends on timing, so re-runs give identical files.
notebooks: $(STAMP)
	for nb in $(NOTEBOOKS); do \
	  $(NB_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	  $(BIN)/jupyter nbconvert --to notebook --inplace --coalesce-streams "$$nb" || exit 1; \
	done

# The static site, from the notebooks' stored outputs (nothing is re-executed): open build/site/index.html
docs: $(DEV_STAMP)
	$(BIN)/python docs/build.py build/site

# Side-by-side timings; writes benchmarks/results.md and the table in README.md. BENCH_ARGS="--repeats 5"
bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

# Rebuild the bundled offline model (committed; see README for why). About a minute on 2 cores.
# Rebuilds the bundled model; downloads the pinned ja-ginza wheel (59 MB, chiVe's word vectors) once into
# ~/.cache/helpers-build/ (CACHE=... to change), checked by SHA-256. Nothing it needs joins requirements.txt.
CACHE ?= $(HOME)/.cache/helpers-build
tiny-model: $(STAMP)
	$(BIN)/python -m helpers.tiny_bert $(MODEL) --cache $(CACHE)

# Download every pinned package, and setuptools and wheel (to build the package and the two sdists), into wheelhouse/,
# for a later `make lab WHEELHOUSE=wheelhouse` on a machine of the same OS, CPU and Python without network.
wheelhouse:
	$(if $(filter cpu,$(TORCH)),$(PYTHON) -m pip download --quiet --no-deps --index-url $(TORCH_CPU_INDEX) -d wheelhouse $(TORCH_PIN))
	$(PYTHON) -m pip download --quiet --find-links wheelhouse -d wheelhouse -r requirements.txt "setuptools>=68" wheel
# On a CUDA machine: execute every notebook (GPU cells active) into a scratch folder and check the memory
# predictions against torch.cuda.max_memory_allocated. Without CUDA it prints one line and exits 0.
gpu-check: $(STAMP)
	$(NB_ENV) $(BIN)/python -m helpers.gpu_check

# Regenerate the README's per-GPU memory chart from the memory model.
memory-chart: $(STAMP)
	mkdir -p docs/img
	$(BIN)/python -m helpers.memory docs/img/per_device_memory.png

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(if $(filter cpu,$(TORCH)),$(BIN)/python -m pip install --quiet --no-deps $(or $(PIP_SOURCE),--index-url $(TORCH_CPU_INDEX)) $(TORCH_PIN))
	$(BIN)/python -m pip install --quiet $(PIP_SOURCE) -r requirements.txt
	$(BIN)/python -m pip install --quiet $(PIP_SOURCE) --no-deps -e .
	touch $@

# Tools for the site, the browser test and the benchmarks; `make lab` does without them.
$(DEV_STAMP): requirements-dev.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
