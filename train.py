"""Trains a Llama with a quantization recipe; resumes when the workdir has a checkpoint.

  python train.py --config=configs/default.py --workdir=runs/demo
  python train.py --config=configs/default.py --workdir=runs/bf16 \\
      --config.quant=bf16 --config.steps=300

Every config field can be overridden with --config.FIELD=VALUE (see
fp4jax.train.config.base_config). `--config.quant=NAME` is shorthand for
`--config.quant.name=NAME` (a preset of fp4jax.recipe_names()); per-role
overrides stay available, e.g. --config.quant.wgrad.hadamard.block=32.

Rerunning a workdir resumes it; only the keys in fp4jax.train.workdir.RESUMABLE_KEYS
(steps, eval/log/checkpoint cadence, target_eval_loss, max_bad_steps, mesh,
...) may differ from its config.json, unless --override_resume is given.

Rerunning also checks that the training files (their names and sizes) are
the ones the checkpoint's data position was saved with; --override_resume
accepts other files too. Both overrides are recorded under history/.

Exit status: 0 when the run completed, reached its target or was stopped by
a signal in the training loop (after saving a checkpoint); 1 when it
diverged, or ran to the end but stopped learning (status "stalled"); 2 on a
user error (config, data, workdir, a full disk: one line naming it); 130 /
143 for SIGINT / SIGTERM during start-up, before the loop.
"""

import sys

# Before the heavy imports: a signal during start-up ends the run cleanly.
from fp4jax import errors  # pylint: disable=g-bad-import-order

errors.exit_on_signals("train.py")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

from fp4jax.train import cli  # pylint: disable=g-import-not-at-top
from fp4jax.train import trainer  # pylint: disable=g-import-not-at-top

_DEFAULT_CONFIG = "configs/default.py"
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics, summary).",
    required=True)
_OVERRIDE_RESUME = flags.DEFINE_bool(
    "override_resume", False,
    "Resume a workdir even though keys other than fp4jax.train.workdir."
    "RESUMABLE_KEYS differ from the config it was run with (its checkpoints "
    "must still fit the model), or its training files changed; what changed "
    "and the previous config.json are kept under history/.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    summary = trainer.train(flags.FLAGS.config, _WORKDIR.value,
                            override_resume=_OVERRIDE_RESUME.value)
  except errors.UserError as e:
    return errors.report("train.py", e)
  return 1 if summary["status"] in ("diverged", "stalled") else 0


if __name__ == "__main__":
  # config_flags reads sys.argv itself to find overrides, so rewrite it first.
  sys.argv = cli.expand_quant_flag(sys.argv)
  try:
    cli.check_config_overrides(sys.argv, default=_DEFAULT_CONFIG)
  except errors.UserError as e:
    sys.exit(errors.report("train.py", e))
  config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "ml_collections config file.")
  app.run(main, flags_parser=cli.flags_parser("train.py"))
