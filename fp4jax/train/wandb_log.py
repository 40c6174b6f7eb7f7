"""Weights & Biases logging beside TensorBoard (`config.wandb`; off by default).

Keys: enabled, project, name (the run's name; "" = the workdir's base name).
wandb is imported only when enabled (`pip install -e ".[wandb]"`); its own
environment variables apply (WANDB_MODE=offline writes the run under
WORKDIR/wandb/ for a later `wandb sync`). The run's id is kept in
WORKDIR/wandb_id, so a resumed run continues the same W&B run.
"""

import importlib.util
import os
import uuid

import ml_collections

from fp4jax.train import run_layout


def wandb_config():
  return ml_collections.ConfigDict(dict(enabled=False, project="fp4jax", name=""))


def check(config):
  """ImportError when enabled without the wandb package (checked at start-up)."""
  if config.enabled and importlib.util.find_spec("wandb") is None:
    raise ImportError('config.wandb.enabled needs the wandb package '
                      '(pip install -e ".[wandb]")')


def open_run(config, workdir, run_config):
  """Starts (or resumes) the W&B run of `workdir`; returns a MetricsLog sink
  (write(row), close()).

  run_config: the resolved config (a dict), shown as the run's config.
  """
  import wandb  # pylint: disable=g-import-not-at-top
  id_path = run_layout.wandb_id_file(workdir)
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:12]
    with open(id_path, "w") as f:
      f.write(run_id + "\n")
  name = config.name or os.path.basename(os.path.abspath(workdir))
  run = wandb.init(project=config.project, name=name, id=run_id,
                   resume="allow", dir=workdir, config=run_config)
  return _Sink(run)


class _Sink:
  """Sends the numeric fields of each metrics row, at the row's step."""

  def __init__(self, run):
    self.run = run

  def write(self, row):
    numbers = {k: v for k, v in row.items()
               if k != "step" and isinstance(v, (int, float))}
    self.run.log(numbers, step=row["step"])

  def close(self):
    self.run.finish()
