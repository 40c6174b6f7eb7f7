"""E5: the paper's cumulative stages at width 128, at two horizons.

  python -m fp4jax.experiments.ablation --config=configs/stage_cumulative.py:0.25 \
      --workdir=runs/stage_cumulative/tpp0.25 --results=results/stage_cumulative/tpp0.25 \
      --git_commit

The argument is the horizon in tokens per non-embedding parameter: 2.6
(E4's, 2,000 steps) or 0.25 (the MLPerf Llama 3.1-8B run's, 192 steps).
Everything else is E4's width 128 (configs/stage_widths.py:128: model,
learning rate 3e-3, batch, warm-up, cosine to 0.1x at the last step,
evaluations every eighth of the run, Wgrad diagnostics every quarter,
tokens-to-target at fp8's loss at 75% of its tokens). The declaration, one
for both horizons, is results/stage_cumulative/DECLARATION.json.

Arms (every arm of a seed: same initialisation and data order):
  fp8   the paper's reference;
  F     `mxfp4-fprop`: Fprop in MXFP4;
  FD    `mxfp4-fprop-dgrad`: Fprop and Dgrad;
  FDW   `mxfp4`: all three GEMMs (no rotation);
  FDWH  `mxfp4-dh16`: all three with the deterministic H16 (E4's D).
"""

import os

from fp4jax.train.cli import load_config_file

ARMS = "fp8; F=mxfp4-fprop; FD=mxfp4-fprop-dgrad; FDW=mxfp4; FDWH=mxfp4-dh16"
WIDTH = 128
# tokens per non-embedding parameter: steps of 1,024 tokens (a multiple of 8
# evaluations); 787,584 non-embedding parameters at width 128.
HORIZONS = {"2.6": 2000, "0.25": 192}
SEEDS = 25
DECLARATION = "results/stage_cumulative/DECLARATION.json"


def get_config(arg="2.6"):
  if arg not in HORIZONS:
    raise ValueError(f"horizon {arg!r} is not one of {sorted(HORIZONS)} "
                     "(tokens per non-embedding parameter)")
  steps = HORIZONS[arg]
  here = os.path.dirname(__file__)
  config = load_config_file(os.path.join(here, f"stage_widths.py:{WIDTH}"))
  config.steps = steps
  config.eval_every = steps // 8
  config.checkpoint_every = steps // 8
  config.diagnostics.every = steps // 4
  config.ablation.arms = ARMS
  config.ablation.seeds = SEEDS
  config.ablation.declaration = DECLARATION
  return config
