"""E4: does the Wgrad penalty grow with the model? The stage arms at three widths.

  python -m fp4jax.experiments.ablation --config=configs/stage_widths.py:128 \
      --workdir=runs/stage_widths/w128 --results=results/stage_widths/w128 --git_commit

The argument is the width (64, 128 or 192); "W,lr=X" sets the learning rate
for the sweep that chooses it (python train.py --config=configs/stage_widths.py:64,lr=0.003
--config.quant.name=fp8 --config.seed=100 --workdir=...). Depth 4, head dim 32 and the
MLP at 3x the width are fixed, so the non-embedding parameters grow with
the width squared: 197,184 / 787,584 / 1,771,200 (8.98x from the first to
the last). Each width trains 2.6 tokens per non-embedding parameter
(E3's horizon at width 128: 2,000 steps of 16 x 64 tokens), rounded to a
whole number of evaluations: 504 / 2,000 / 4,496 steps. Evaluation (16
batches of 32 windows of 65 tokens) every eighth of the run, Wgrad
diagnostics every quarter, checkpoints every eighth; the tokens-to-target
target is fp8's validation loss at 75% of its tokens, same seed. The learning rate is
the width's, chosen on the fp8 arm alone before any other arm ran (the
rule, the grid and the sweep's runs: results/stage_widths/DECLARATION.json).

Arms (every arm of a seed: same initialisation and data order):
  fp8   the paper's reference: E4M3 forward, E5M2 gradients, per-tensor scales;
  W     fp8 with Wgrad in MXFP4 (the `mxfp4` preset's Wgrad: even scales,
        round to nearest even, no rotation);
  WH    W with the deterministic 16-point Hadamard on Wgrad's operands (the
        `mxfp4-dh16` preset's Wgrad);
  D     `mxfp4-dh16`, all three GEMMs MXFP4 + H16: the paper's final recipe.
"""

import os

from fp4jax.experiments import ablation
from fp4jax.train.cli import load_config_file

_WGRAD_MX = ("wgrad.lhs.fmt=mxfp4,wgrad.rhs.fmt=mxfp4,"
             "wgrad.lhs.scale_mode=even,wgrad.rhs.scale_mode=even")
ARMS = f"fp8; W=fp8:{_WGRAD_MX}; WH=fp8:{_WGRAD_MX},wgrad.hadamard.block=16; D=mxfp4-dh16"

# width: (heads, kv heads, steps)
WIDTHS = {64: (2, 1, 504), 128: (4, 2, 2000), 192: (6, 3, 4496)}
# The learning rate of each width, chosen on the fp8 arm by the declared rule
# before any other arm ran (results/stage_widths/lr_sweep/README.md).
LEARNING_RATES = {64: 6e-3, 128: 3e-3, 192: 7.5e-4}


def get_config(arg="128"):
  width, _, lr = arg.partition(",lr=")
  width = int(width)
  if width not in WIDTHS:
    raise ValueError(f"width {width} is not one of {sorted(WIDTHS)}")
  lr = float(lr) if lr else LEARNING_RATES[width]
  heads, kv_heads, steps = WIDTHS[width]
  config = load_config_file(os.path.join(os.path.dirname(__file__), "ablation_tiny.py"))
  config.model.dim = width
  config.model.n_heads = heads
  config.model.n_kv_heads = kv_heads
  config.model.mlp_dim = 3 * width
  config.steps = steps
  config.lr = lr
  config.warmup_steps = 30
  config.min_lr_ratio = 0.1
  config.eval_every = steps // 8
  config.checkpoint_every = steps // 8
  config.log_every = 10
  config.ablation = ablation.ablation_config()
  config.ablation.recipes = ""
  config.ablation.arms = ARMS
  config.ablation.baseline = "fp8"
  config.ablation.seeds = 8
  config.ablation.late_from = 0.5
  config.ablation.target_at = 0.75
  config.ablation.declaration = f"results/stage_widths/w{width}/DECLARATION.json"
  config.diagnostics.every = steps // 4
  config.diagnostics.window = 3
  return config
