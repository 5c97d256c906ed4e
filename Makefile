# Two commands do all set-up on a fresh machine:  make lab  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL := src/helpers/assets/tiny-japanese-bert
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb)) $(sort $(wildcard notebooks/solutions/*.ipynb))

# Stored notebook outputs must not depend on progress bars or hub look-ups.
NB_ENV := TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
NBVAL := --nbval --nbval-current-env

.PHONY: lab test unit notebooks tiny-model gpu-check memory-chart clean

# Jupyter refuses to start as root (containers, CI images) unless told so.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

test: $(STAMP)
	$(NB_ENV) $(BIN)/python -m pytest tests $(NBVAL) notebooks

unit: $(STAMP)
	$(BIN)/python -m pytest tests

# Re-execute every notebook top to bottom, in place, so committed outputs are the code's own.
# The second pass merges stream chunks, whose split depends on timing, so re-runs give identical files.
notebooks: $(STAMP)
	for nb in $(NOTEBOOKS); do \
	  $(NB_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	  $(BIN)/jupyter nbconvert --to notebook --inplace --coalesce-streams "$$nb" || exit 1; \
	done

# Rebuild the bundled offline model (committed; see README for why). About a minute on 2 cores.
tiny-model: $(STAMP)
	$(BIN)/python -m helpers.tiny_bert $(MODEL)

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
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
