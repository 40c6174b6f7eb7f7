"""The 125M-shape ablation cut to fit one 9-minute device call: fp8, mxfp4, mxfp4-dh16, 300 steps.

  timeout -k 10 480 python -m fp4jax.experiments.ablation \
      --config=configs/ablation_gpu_short.py --workdir=/tmp/ablation_gpu_short \
      --results=$OUT/ablation_gpu_short

configs/ablation_gpu.py (llama-125m shape, 32 x 1024 tokens a step, bf16
compute, lr 1e-3) with three recipes on one seed for 300 steps (30 warm-up,
cosine to 0.1), evaluation every 50 steps, diagnostics (operand and output
errors with and without rotation at width 768) every 100 steps on windows of
3, one checkpoint at the end. Checkpoints stay in the workdir, outside the
results; each finished run's records are copied into the --results folder as
it completes, so what finished before the `timeout` comes back, and a second
call (with that folder carried back) trains only the rest. Not run yet: the
size is an estimate (one compile and ~300 short steps per recipe).
"""

import os

from fp4jax.train.cli import load_config_file


def get_config():
  config = load_config_file(os.path.join(os.path.dirname(__file__), "ablation_gpu.py"))
  config.steps = 300
  config.warmup_steps = 30
  config.eval_every = 50
  config.checkpoint_every = 300
  config.keep_checkpoints = 1
  config.log_every = 10
  config.ablation.recipes = "fp8,mxfp4,mxfp4-dh16"
  config.ablation.seeds = 1
  config.diagnostics.every = 100
  config.diagnostics.window = 3
  return config
