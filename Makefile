# `make train` runs the default training job on CPU; `make test` runs the test suite.
# Both create .venv and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install extras train test test-all test-torch bench clean

# A pip constraint holding the environment's installed torch (torch==<its version>, e.g.
# 2.13.0+cpu), passed to every pip install of this package's extras: pyproject.toml's torch
# range (>=2.13,<2.16) lets pip's resolver, when it backtracks (the test extra's
# s3fs/aiobotocore/fsspec chain makes it), replace the installed torch by the newest one the range
# allows, a multi-GB CUDA build.
TORCH_PIN := $(VENV)/torch-constraint.txt
WRITE_TORCH_PIN = $(PY) -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > $(TORCH_PIN)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: the CPU build of torch. A loose requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(WRITE_TORCH_PIN)
	$(PY) -m pip install -q -c $(TORCH_PIN) -e '.[test]'
	touch $@

# Optional dependencies (pyproject.toml's extras) into an environment, keeping its torch:
#   make extras EXTRAS=recipes        (or EXTRAS=recipes,s3; VENV=<env> for another environment)
# An environment without bin/python is made first with `make install`.
extras:
	@test -n "$(EXTRAS)" || { echo "usage: make extras EXTRAS=recipes[,s3,...] [VENV=<env>]"; exit 2; }
	test -x $(PY) || $(MAKE) install
	$(WRITE_TORCH_PIN)
	$(PY) -m pip install -q -c $(TORCH_PIN) -e '.[$(EXTRAS)]'

# Through scripts/train.sh: the config is checked before torchrun starts, SIGTERM saves and exits 0.
train: install
	NPROC=$(NPROC) TORCHRUN=$(VENV)/bin/torchrun PYTHON=$(PY) scripts/train.sh $(ARGS)

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: the suite starts a few hundred
# rank and recipe processes, each of which would otherwise compile the package's sources again.
test: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q $(ARGS)

# Every test, those marked slow included (each also covered by a faster one in `make test`).
test-all: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m '' $(ARGS)

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
