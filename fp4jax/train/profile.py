"""A profiler window over a few training steps (`config.profile`).

Keys: enabled (off by default), start_step (the first traced step, numbered
from 1 as in metrics.jsonl; 0 = the second step this process runs, so that
the first, compiling step is left out), steps (how many to trace).

The jax.profiler trace goes to WORKDIR/tensorboard/plugins/profile/<run>/,
where TensorBoard's profile plugin (`tensorboard --logdir
WORKDIR/tensorboard`) and xprof find it.
"""

import jax
import ml_collections

from fp4jax.train import run_layout


def profile_config():
  return ml_collections.ConfigDict(dict(enabled=False, start_step=0, steps=3))


def check(config):
  """ValueError naming the key when the window cannot be opened."""
  if config.enabled and (config.steps < 1 or config.start_step < 0):
    raise ValueError(f"config.profile needs steps >= 1 and start_step >= 0 "
                     f"(0 = after the first step), got steps={config.steps}, "
                     f"start_step={config.start_step}")


class Window:
  """Starts the trace before the window's first step, stops it after its last.

  `before(step)` / `after(step)` are called around each step (`step`: the
  step's number, from 1); the loop's first step is `first_step`.
  """

  def __init__(self, config, workdir, first_step):
    self.logdir = run_layout.tensorboard(workdir)
    self._on = config.enabled and config.steps > 0
    self._start = config.start_step or first_step + 1
    self._stop = self._start + config.steps - 1
    self._tracing = False

  def before(self, step):
    if self._on and step == self._start:
      jax.profiler.start_trace(self.logdir)
      self._tracing = True

  def after(self, step):
    if self._tracing and step >= self._stop:
      self.close()

  def close(self):
    """Ends a trace still open (a run that stops inside the window)."""
    if self._tracing:
      jax.profiler.stop_trace()
      self._tracing = False
