"""python -m fp4jax.audit CONFIG-or-RUN [--config.KEY=VALUE ...]

Traces the train step of a config file (e.g. configs/default.py) or of a run
directory (its config.json), as the trainer builds it, and prints every
GEMM's precision as it is in the trace, per layer and role, beside what the
recipe asks (fp4jax.audit). `--config.KEY=VALUE` overrides a key as train.py
does (`--config.quant=NAME` names a preset). Nothing is compiled or run.

Exit status: 0 when every GEMM runs as its recipe asks, 1 when some do not
(each printed as MISMATCH), 2 on bad input (one line).
"""

import os
import sys

from fp4jax import errors

if __name__ == "__main__":  # before the heavy imports: see errors.exit_on_signals
  errors.exit_on_signals("fp4jax.audit", "during the audit; stopped.")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top
import ml_collections  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

from fp4jax.train import cli  # pylint: disable=g-import-not-at-top

PROG = "fp4jax.audit"
USAGE = f"usage: python -m {PROG} CONFIG.py-or-RUN_DIR [--config.KEY=VALUE ...]"


def _run_config(run):
  """The ConfigDict a run directory was trained with: its config.json over
  base_config(), so that every key keeps its type for --config overrides."""
  from fp4jax.train import config as train_config  # pylint: disable=g-import-not-at-top
  from fp4jax.train import run_layout  # pylint: disable=g-import-not-at-top
  saved, problem = run_layout.saved_config(run)
  if problem is not None:
    raise errors.UserError(f"{run!r} is a folder but not an fp4jax run: its "
                           f"{run_layout.CONFIG} {problem}")
  config = train_config.base_config()
  _merge(config, {k: v for k, v in saved.items() if k != "resolved"})
  return config


def _merge(config, saved):
  """config's keys set to saved's values: None (a placeholder) and keys config lacks
  are left out, lists become tuples (what JSON made of them)."""
  for key, value in saved.items():
    if key not in config or value is None:
      continue
    if isinstance(value, dict) and isinstance(config[key], ml_collections.ConfigDict):
      _merge(config[key], value)
    else:
      config[key] = tuple(value) if isinstance(value, list) else value


def define_config(argv):
  """Defines the absl flag `config` from argv[1] (a config file or a run directory)
  and sets sys.argv to argv with that argument as --config=FILE (a file) or dropped
  (a run), which config_flags reads its overrides from; returns that argv."""
  if len(argv) < 2 or argv[1].startswith("-"):
    raise errors.UserError(f"give a config file or a run directory first; {USAGE}")
  target, rest = argv[1], cli.expand_quant_flag(argv[2:])
  if os.path.isdir(target):
    config = _run_config(target)
    sys.argv = [argv[0]] + rest
    config_flags.DEFINE_config_dict("config", config, "the run's config")
    return sys.argv
  if not target.partition(":")[0].endswith(".py"):
    raise errors.UserError(f"{target!r} is neither a config file (.py) nor a run "
                           f"directory; {USAGE}")
  new = [argv[0], f"--config={target}"] + rest
  cli.check_config_overrides(new)
  sys.argv = new
  config_flags.DEFINE_config_file("config", target, "ml_collections config file")
  return new


def main(argv):
  """absl's main: the audit of the flag `config`; 0, 1 (mismatches) or 2."""
  from fp4jax import audit  # pylint: disable=g-import-not-at-top
  from fp4jax.audit import report  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent backends
  try:
    audits = audit.audit_config(flags.FLAGS.config)
  except errors.UserError as e:
    return errors.report(PROG, e)
  bad = 0
  for segment, rows in audits:
    print(segment)
    print(report.table(rows))
    print(f"audit: {report.summary(rows)}")
    bad += sum(1 for r in rows if r.mismatch)
  return 1 if bad else 0


def run(argv):
  """The command: argv checked (bad input: one line, status 2) before JAX is
  imported, then absl runs `main` (it exits with main's status)."""
  try:
    argv = define_config(argv)
  except errors.UserError as e:
    return errors.report(PROG, e)
  app.run(main, argv=argv, flags_parser=cli.flags_parser(PROG))
  return 0


if __name__ == "__main__":
  sys.exit(run(sys.argv))
