"""E1, the long-horizon study: does Wgrad error that changes every step accumulate?

  python -m fp4jax.experiments.ablation --config=configs/horizon_tiny.py \
      --workdir=runs/horizon_tiny --results=results/horizon_tiny --git_commit

The tiny model and data of configs/ablation_tiny.py (dim 128, 4 layers, bf16
compute, stdlib corpus, byte tokenizer), batch 16 x 64, 2,000 steps with a
constant lr of 3e-3 after 30 warm-up steps (min_lr_ratio 1.0: every
evaluation is a valid horizon and steps can be raised on resume). Evaluation,
diagnostics (window 3) and checkpoints every 250 steps; training rows every 10.
Arms, all mxfp4-dh16 with only Wgrad changed (the rules and predictions are in
results/horizon_tiny/DECLARATION.json, recorded before the first run):
  A0  mxfp4-dh16 unchanged (deterministic H16 everywhere);
  A1  Wgrad H16 with signs drawn afresh every step;
  A2  Wgrad H16 with signs drawn once per layer (random, fixed in time);
  A3  Wgrad stochastic rounding on both operands (H16 as A0);
  fp8 on seed 0 only, an anchor.
Seeds 0-2, seed-major (a partial study holds complete pairs); each finished
run's records are committed to results/horizon_tiny as it completes, and a
rerun skips the runs complete there.
"""

import os

from fp4jax.train.cli import load_config_file
from fp4jax.experiments import ablation

ARMS = ("A0=mxfp4-dh16; "
        "A1=mxfp4-dh16:wgrad.hadamard.signs=per-step; "
        "A2=mxfp4-dh16:wgrad.hadamard.signs=per-layer; "
        "A3=mxfp4-dh16:wgrad.lhs.rounding=stochastic,wgrad.rhs.rounding=stochastic; "
        "fp8")


def get_config():
  config = load_config_file(os.path.join(os.path.dirname(__file__), "ablation_tiny.py"))
  config.steps = 2000
  config.lr = 3e-3
  config.warmup_steps = 30
  config.min_lr_ratio = 1.0
  config.eval_every = 250
  config.checkpoint_every = 250
  config.log_every = 10
  config.ablation = ablation.ablation_config()
  config.ablation.recipes = ""
  config.ablation.arms = ARMS
  config.ablation.baseline = "A0"
  config.ablation.seeds = 3
  config.ablation.recipe_seeds = "fp8:1"
  config.ablation.late_from = 0.5
  config.ablation.declaration = "results/horizon_tiny/DECLARATION.json"
  config.diagnostics.every = 250
  config.diagnostics.window = 3
  return config
