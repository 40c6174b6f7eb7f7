"""The adaptive Wgrad switch against fixed schedules, on the CPU (docs/adaptive.md).

  python train.py --config=configs/adaptive_tiny.py:ARM --workdir=runs/adaptive/ARM_seed0 \
      --config.seed=0

The model, data and budget of configs/ablation_tiny.py (tiny Llama, 861K
parameters, bf16 compute, 300 steps of 16 x 64 tokens, validation on 512
windows every 50 steps); Fprop and Dgrad are mxfp4-sr in every arm, Wgrad:

  fp4        mxfp4-sr's (MXFP4, stochastic rounding) throughout
  fp8        the fp8 preset's (per-tensor E4M3 X, E5M2 dY) throughout
  schedule   MXFP4 until step 150, then FP8 (config.quant_schedule)
  adaptive   MXFP4, each block moving to FP8 once its Wgrad snr_true was
             below the default sqrt(3) on 3 measurements in a row (every 20
             steps).
"""

import os

from fp4jax.experiments import ablation
from fp4jax.train.cli import load_config_file

ARMS = ("fp4", "fp8", "schedule", "adaptive")


def _fp8_operand(fmt):
  return {"fmt": fmt, "rounding": "nearest", "block_size": None, "scale_mode": "floor"}


FP8_WGRAD = {"lhs": _fp8_operand("fp8_e4m3"), "rhs": _fp8_operand("fp8_e5m2")}


def get_config(arm="adaptive"):
  if arm not in ARMS:
    raise ValueError(f"configs/adaptive_tiny.py: arm {arm!r} is not one of {', '.join(ARMS)}")
  config = ablation.run_config(
      load_config_file(os.path.join(os.path.dirname(__file__), "ablation_tiny.py")),
      "mxfp4-sr", seed=0)
  if arm == "fp8":
    for operand, fields in FP8_WGRAD.items():
      config.quant.wgrad[operand].update(fields)
  elif arm == "schedule":
    config.quant_schedule = ((150, {"name": "mxfp4-sr", "wgrad": FP8_WGRAD}),)
  elif arm == "adaptive":
    config.adaptive_wgrad.update(dict(enabled=True, window=3, every=20, to="fp8"))
  return config
