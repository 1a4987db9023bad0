# `make train` runs the default training job on CPU; `make test` runs the test suite.
# Both create .venv and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install train test bench clean

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

clean:
	rm -rf $(VENV) outputs .pytest_cache
