"""Test-wide setup: eight virtual CPU devices, so sharding tests can build meshes,
LLVM's -O1 for the compiled programs, and one JAX compilation cache for all the
processes of a test run.

The flags must be set before JAX initialises its backends, hence here.
"""

import atexit
import os
import shutil
import tempfile

import pytest

# LLVM at -O1 instead of XLA's default -O2: compiling dominates the suite and
# takes about a third less time, with the same bits (test_compile_level checks
# this against the default level; -O0 changes bf16 and fp8 GEMM results).
COMPILE_LEVEL = "--xla_backend_optimization_level=1"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    + ([] if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
       else [COMPILE_LEVEL])).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The pytest-xdist workers and the train.py processes the tests start inherit
# this environment, so a program that several of them build (the tiny train
# step) compiles once per run. The cache is a fresh temporary directory that
# the first process of the run (the one without FP4JAX_TEST_JAX_CACHE) removes.
if "FP4JAX_TEST_JAX_CACHE" not in os.environ:
  os.environ["FP4JAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="fp4jax-test-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["FP4JAX_TEST_JAX_CACHE"], True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["FP4JAX_TEST_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture
def one_device():
  """The trainer's mesh on the first of the 8 virtual devices, for a test whose
  runs compare with each other and not with a mesh: one device compiles a train
  step in about half the time of eight."""
  import sharded_runs  # pylint: disable=import-outside-toplevel
  with sharded_runs.on_first_devices(1):
    yield
