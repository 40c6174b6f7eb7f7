# The two commands of the README: `make train` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
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
	rm -rf $(VENV) runs
