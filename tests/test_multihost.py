"""Two real JAX processes on localhost train like one process.

Each process owns 4 virtual CPU devices; jax.distributed connects them
through a loopback coordinator and Gloo CPU collectives, the trainer builds a
2x2x2 mesh over all 8 and each process feeds its half of the batch.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import sharded_runs

pytestmark = pytest.mark.slow  # two processes, each training

STEPS = 2
TIMEOUT_S = 300


def _gloo_available():
  try:
    from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.skipif(not _gloo_available(),
                    reason="this jaxlib has no Gloo CPU collectives "
                    "(jax._src.lib._jax.make_gloo_tcp_collectives), so it "
                    "cannot run a multi-process CPU computation")
def test_two_processes_agree_with_one(tmp_path):
  recipe = "mxfp4-dh16"
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  coordinator = f"127.0.0.1:{_free_port()}"
  script = os.path.join(os.path.dirname(__file__), "sharded_runs.py")
  procs, logs = [], []
  for pid in range(2):
    log = open(tmp_path / f"process_{pid}.log", "w+")
    logs.append(log)
    procs.append(subprocess.Popen(
        [sys.executable, script, coordinator, "2", str(pid), str(workdir),
         recipe, str(STEPS)],
        env=env, stdout=log, stderr=subprocess.STDOUT))
  try:
    _, ref, _ = sharded_runs.reference(recipe, (2, 2, 2))  # while the two processes train
    for p in procs:
      p.wait(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read()[-3000:])
    log.close()
  codes = [p.returncode for p in procs]
  assert codes == [0, 0], f"exit codes {codes}:\n" + "\n----\n".join(outputs)

  got = sharded_runs.metrics(workdir)
  assert sorted(s for s in got if s) == list(range(1, STEPS + 1))
  # Step 1 runs on the same parameters: only the order of float32 sums
  # differs (Gloo vs in-process all-reduce). Step 2's parameters carry that
  # difference through one update.
  np.testing.assert_allclose(got[1]["loss"], ref[1]["loss"], rtol=1e-5)
  np.testing.assert_allclose(got[1]["grad_norm"], ref[1]["grad_norm"],
                             rtol=1e-5)
  np.testing.assert_allclose(got[2]["loss"], ref[2]["loss"], rtol=1e-4)
  np.testing.assert_allclose(got[0]["eval_loss"], ref[0]["eval_loss"],
                             rtol=1e-6)
  # Both processes wrote their shards of one checkpoint; only process 0
  # wrote the logs.
  assert (workdir / "checkpoints" / str(STEPS)).is_dir()
  assert "fp4jax run completed" in outputs[0]
  assert "fp4jax run completed" not in outputs[1]
