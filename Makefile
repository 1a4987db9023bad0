# `make train` runs the default training job on CPU; `make test` runs the test suite.
# Both create .venv and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install train test test-torch bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: the CPU build of torch. A loose requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Through scripts/train.sh: the config is checked before torchrun starts, SIGTERM saves and exits 0.
train: install
	NPROC=$(NPROC) TORCHRUN=$(VENV)/bin/torchrun PYTHON=$(PY) scripts/train.sh $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

# The suite on another torch version, in its own venv .venv-torch-<version> (not in CI):
#   make test-torch TORCH=2.15.0 [ARGS="tests/fully_shard -x"]
# A version outside pyproject.toml's declared torch range fails to install (pip says why).
# PIP_CONSTRAINT (a file in the venv holding torch==<version>) keeps the dependencies from
# moving torch, and replaces for this install only a machine-wide pip constraint that caps torch
# below the version asked for.
TORCH_VENV := .venv-torch-$(TORCH)
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=<version> [ARGS=...]"; exit 2; }
	test -x $(TORCH_VENV)/bin/python || python3 -m venv $(TORCH_VENV)
	echo 'torch==$(TORCH)' > $(TORCH_VENV)/torch-constraint.txt
	PIP_CONSTRAINT=$(TORCH_VENV)/torch-constraint.txt $(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH) -e '.[test]'
	$(TORCH_VENV)/bin/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
