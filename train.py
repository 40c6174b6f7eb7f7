"""Trains a Llama with a quantization recipe; resumes when the workdir has a checkpoint.

  python train.py --config=configs/default.py --workdir=runs/demo
  python train.py --config=configs/default.py --workdir=runs/bf16 \\
      --config.quant=bf16 --config.steps=300

Every config field can be overridden with --config.FIELD=VALUE (see
fp4jax.trainer.base_config). `--config.quant=NAME` is shorthand for
`--config.quant.name=NAME` (a preset of fp4jax.recipe_names()); per-role
overrides stay available, e.g. --config.quant.wgrad.hadamard.block=32.

Exit status: 0 when the run completed, reached its target or was stopped by
a signal (after saving a checkpoint); 1 when it diverged; 2 on a bad config.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from fp4jax import trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "ml_collections config file.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics, summary).",
    required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    summary = trainer.train(_CONFIG.value, _WORKDIR.value)
  except trainer.ConfigError as e:
    print(f"train.py: {e}", file=sys.stderr)
    return 2
  return 1 if summary["status"] == "diverged" else 0


if __name__ == "__main__":
  # config_flags reads sys.argv itself to find overrides, so rewrite it there.
  sys.argv = trainer.expand_quant_flag(sys.argv)
  app.run(main)
