"""Small sharded training runs shared by the sharding tests.

`train_on(recipe, mesh, workdir)` trains `small_config` in this process on the
first data x fsdp x tensor of the 8 virtual devices; `reference(...)` caches
such runs per process. Run as a script, this file is one process of a
multi-process run (tests/test_multihost.py starts two):

  python tests/sharded_runs.py COORDINATOR NUM_PROCESSES PROCESS_ID WORKDIR \
      RECIPE STEPS

with XLA_FLAGS giving each process its share of the CPU devices.
"""

import atexit
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile

import jax

from fp4jax import sharding
from fp4jax.train import config as train_config
from fp4jax.train import trainer

STEPS = 4
N_LAYERS = 1


def small_config(recipe, mesh=(1, 1, 1), steps=STEPS):
  """One-layer tiny Llama, 8 x 32 tokens a step, a loss that moves each step.

  Checkpoints at step 3 (and at the end), so a run can be resumed at 3.
  """
  c = train_config.base_config()
  c.quant.name = recipe
  c.model.n_layers = N_LAYERS
  c.steps = steps
  c.batch_size = 8
  c.seq_len = 32
  c.lr = 1e-2
  c.warmup_steps = 0
  c.eval_every = steps
  c.eval_batches = 1
  c.checkpoint_every = 3
  c.log_every = 1
  c.async_checkpointing = False
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def metrics(workdir):
  """metrics.jsonl of a run as {step: row}."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows}


@contextlib.contextmanager
def on_first_devices(n):
  """The trainer builds its mesh on the first n devices of this process."""
  make_mesh = sharding.make_mesh
  sharding.make_mesh = lambda cfg, devices=None: make_mesh(
      cfg, jax.devices()[:n])
  try:
    yield
  finally:
    sharding.make_mesh = make_mesh


def layout(tree):
  """{path: (PartitionSpec, mesh shape, shard shape)} of a tree of arrays."""
  return {jax.tree_util.keystr(path): (x.sharding.spec, dict(x.sharding.mesh.shape),
                                       x.addressable_shards[0].data.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def train_on(recipe, mesh, workdir):
  """Trains small_config on `mesh` in `workdir`.

  Returns (metrics(workdir), layout of the TrainState after step 1).
  """
  seen = {}

  def record(step, state, batch):
    del batch
    if not seen:  # the first step of this run
      seen.update(layout(state))

  with on_first_devices(math.prod(mesh)):
    trainer.train(small_config(recipe, mesh), workdir, callbacks=(record,))
  return metrics(workdir), seen


_RUNS = {}


def reference(recipe, mesh):
  """(workdir, metrics, layout) of train_on(recipe, mesh), once per process."""
  if (recipe, mesh) not in _RUNS:
    name = f"fp4jax_{recipe}_{'x'.join(map(str, mesh))}_"
    workdir = tempfile.mkdtemp(prefix=name)
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    _RUNS[recipe, mesh] = (workdir, *train_on(recipe, mesh, workdir))
  return _RUNS[recipe, mesh]


def main(argv):
  coordinator, num_processes, process_id, workdir, recipe, steps = argv
  c = small_config(recipe, mesh=(2, 2, 2), steps=int(steps))
  c.distributed.coordinator = coordinator
  c.distributed.num_processes = int(num_processes)
  c.distributed.process_id = int(process_id)
  trainer.train(c, workdir)


if __name__ == "__main__":
  main(sys.argv[1:])
