"""E3: is "stochastic rounding fails" a property of SR or of a biased SR?

  python -m fp4jax.experiments.ablation --config=configs/sr_bias_tiny.py \
      --workdir=runs/sr_bias_tiny --results=results/sr_bias_tiny --git_commit

E1's model, data and schedule (configs/horizon_tiny.py: the tiny model of
configs/ablation_tiny.py, 2,000 steps of 16 x 64 tokens, constant lr 3e-3
after 30 warm-up steps, evaluation, diagnostics and checkpoints every 250
steps). Arms, all mxfp4-dh16 with only Wgrad changed (rules, sizes and
predictions in results/sr_bias_tiny/DECLARATION.json, recorded before the
first run):
  R0  mxfp4-dh16 unchanged (Wgrad rounds to nearest even after H16; E1's A0);
  S1  Wgrad stochastic rounding on both operands, unbiased (E1's A3);
  S2  S1 with the round-up probability halved (sr_round_up_scale=0.5: the
      SR of AMD Primus-Turbo before its PR #430);
  S3  S1 with 8 random bits per element (sr_bits=8);
  P1  Wgrad H16 with signs drawn afresh every step (E1's A1);
  P2  Wgrad H16 with signs drawn once per layer (E1's A2).
Seeds 0-8 for R0 and S1-S3, 0-6 for P1 and P2, seed-major.
"""

import os

from fp4jax.train.cli import load_config_file

_SR = "wgrad.lhs.rounding=stochastic,wgrad.rhs.rounding=stochastic"
ARMS = (f"R0=mxfp4-dh16; "
        f"S1=mxfp4-dh16:{_SR}; "
        f"S2=mxfp4-dh16:{_SR},wgrad.lhs.sr_round_up_scale=0.5,wgrad.rhs.sr_round_up_scale=0.5; "
        f"S3=mxfp4-dh16:{_SR},wgrad.lhs.sr_bits=8,wgrad.rhs.sr_bits=8; "
        "P1=mxfp4-dh16:wgrad.hadamard.signs=per-step; "
        "P2=mxfp4-dh16:wgrad.hadamard.signs=per-layer")


def get_config():
  config = load_config_file(os.path.join(os.path.dirname(__file__), "horizon_tiny.py"))
  config.ablation.arms = ARMS
  config.ablation.baseline = "R0"
  config.ablation.seeds = 9
  config.ablation.recipe_seeds = "P1:7,P2:7"
  config.ablation.declaration = "results/sr_bias_tiny/DECLARATION.json"
  return config
