# The two commands of the README: `make train` (the main job) and `make test`.
# PYTHON picks the interpreter (e.g. `make test PYTHON=python3.12`); each
# interpreter gets its own virtual environment, .venv for the default python3
# and .venv-<name> for any other, so the two never clash.
PYTHON ?= python3
VENV ?= .venv$(if $(filter python3,$(PYTHON)),,-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
WORKDIR ?= runs/demo

.PHONY: train test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

train: install
	$(PY) train.py --config=configs/default.py --workdir=$(WORKDIR)

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf .venv .venv-* runs
