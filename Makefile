# The two commands of the README: `make train` (the main job) and `make test`
# (the whole suite); `make test-fast` runs the numerics, dot_general, recipes and backends tests.
# PYTHON picks the interpreter (e.g. `make test PYTHON=python3.12`); each
# interpreter gets its own virtual environment, .venv for the default python3
# and .venv-<name> for any other, so the two never clash. EXTRAS picks the
# pyproject extras installed (e.g. `make test EXTRAS=test,interop` adds torch
# and transformers); each set has its own stamp, so a new set installs.
# --max-worker-restart=0: a test that takes its worker process down ends the run at
# once, naming the test (pytest-xdist 3.8's loadfile scheduler can wait forever after
# it replaces a crashed worker).
PYTHON ?= python3
VENV ?= .venv$(if $(filter python3,$(PYTHON)),,-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
EXTRAS ?= test
WORKDIR ?= runs/demo

.PHONY: train test test-fast test-maxtext test-gpu-compile test-llamacpp install clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

train: install
	$(PY) train.py --config=configs/default.py --workdir=$(WORKDIR)

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 tests

# The numerics, dot_general, recipes and backends (and the layout checks): a few minutes.
FAST_TESTS := $(addprefix tests/test_,formats.py scales.py element_tables.py numpy_reference.py \
  hadamard.py blocks2d.py quest.py eden.py four_over_six.py dot.py recipes.py backends.py \
  layout.py readme_layout.py configs.py)

test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 -m "not slow" $(FAST_TESTS)

# fp4jax recipes inside MaxText (Python >= 3.12): its own suite, with the maxtext extra.
test-maxtext:
	$(MAKE) install PYTHON=$(PYTHON) EXTRAS=test,maxtext
	$(PY) -m pytest -q -n 2 --max-worker-restart=0 tests/test_maxtext.py

# fp4jax's GPU paths through XLA's real GPU compiler for H200 and B200, without a GPU
# (Python >= 3.12): its own environment, with jax's CUDA plugin (the gpu-compile extra, ~4.4 GB).
GPU_COMPILE_VENV ?= .venv-gpu-compile

test-gpu-compile:
	$(MAKE) install PYTHON=$(PYTHON) VENV=$(GPU_COMPILE_VENV) EXTRAS=test,gpu-compile
	$(GPU_COMPILE_VENV)/bin/python -m pytest -q -n 2 --dist load --max-worker-restart=0 tests/test_gpu_compile.py \
	  tests/test_sass_loops.py

# llama.cpp itself on fp4jax's GGUF exports (tests/test_llamacpp.py): its own
# environment with the llamacpp extra, whose llama-cpp-python builds llama.cpp
# from source with cmake (minutes on 2 cores the first time; pip caches the
# wheel). LLAMACPP_CMAKE_ARGS leaves out the multimodal library it does not need.
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF

test-llamacpp:
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(MAKE) install PYTHON=$(PYTHON) VENV=$(LLAMACPP_VENV) \
	  EXTRAS=test,llamacpp
	$(LLAMACPP_VENV)/bin/python -m pytest -q -p no:xdist tests/test_llamacpp.py

clean:
	rm -rf .venv .venv-* runs
