"""E2, a learning-rate stress screen: fp8, A0, A1, A3 of configs/horizon_tiny.py at a high peak lr.

  for lr in 1e-2 3e-2; do
    python -m fp4jax.experiments.ablation --config=configs/stress_tiny.py:$lr \
        --workdir=runs/stress_tiny/lr$lr --results=results/stress_tiny/lr$lr --git_commit
  done
  python -m fp4jax.experiments.horizon stress results/stress_tiny

The model, data, batch and arms of configs/horizon_tiny.py; the peak lr is
the config argument (constant after 30 warm-up steps), 600 steps, seed 0,
every training step logged (the statistics need each one): the step of the
first non-finite loss, the skipped steps, the first step whose loss exceeds
the running minimum by 1 nat, the final validation loss
(fp4jax.experiments.horizon.stress_outcome). One seed: a screen, not a verdict.
"""

import os

from fp4jax.train.cli import load_config_file

ARMS = ("A0", "A1", "A3", "fp8")


def get_config(lr="1e-2"):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "horizon_tiny.py"))
  config.lr = float(lr)
  config.steps = 600
  config.eval_every = 100
  config.checkpoint_every = 600
  config.log_every = 1
  config.ablation.arms = "; ".join(a.strip() for a in config.ablation.arms.split(";")
                                   if a.split("=")[0].strip() in ARMS)
  config.ablation.seeds = 1
  config.ablation.recipe_seeds = ""
  config.ablation.declaration = ""
  config.diagnostics.every = 100
  return config
