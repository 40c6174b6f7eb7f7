"""A run directory's layout, spelled once: the names the trainer (and the
ablation runner) give a run's files, their paths, and the readers of them.

  checkpoints/<step>/    orbax checkpoints (what is inside: fp4jax.checkpointing)
  checkpoints_corrupt/   unreadable checkpoints set aside (<step>, <step>.2, ...)
  config.json            the resolved config (`saved_config`; a copy rides in
                         every checkpoint: `checkpoint_config`)
  metrics.jsonl          one row per logged step (fp4jax.train.metrics_log)
  summary.json           the closing summary (`read_summary`)
  tensorboard/           TensorBoard events and profiler traces
  wandb_id               the Weights & Biases run id (fp4jax.train.wandb_log)
  lock                   while a run holds the workdir (fp4jax.train.workdir)
  history/<n>/           RECORDS a restart set aside, resume_override.json
  wall.json              the ablation's wall time, code and environments of
                         the run (`read_wall`; fp4jax.experiments.ablation)

A saved config is judged by one rule, `usable_config`: a JSON object with
the model, quant and resolved blocks the trainer writes (records.RunConfig).
"""

import json
import os

from fp4jax import checkpointing
from fp4jax import records

CHECKPOINTS = "checkpoints"
CORRUPT_CHECKPOINTS = "checkpoints_corrupt"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TENSORBOARD = "tensorboard"
WANDB_ID = "wandb_id"
LOCK = "lock"
HISTORY = "history"
RESUME_OVERRIDE = "resume_override.json"
WALL = "wall.json"
# A run's records: what a restart copies to history/<n>/ before it drops rows.
RECORDS = (METRICS, SUMMARY, CONFIG)


def _in_run(name):
  """The function RUN -> RUN/<name> (a path: nothing is read)."""
  def path(run):
    return os.path.join(run, name)
  path.__doc__ = f"RUN/{name}"
  return path


checkpoints = _in_run(CHECKPOINTS)
corrupt_checkpoints = _in_run(CORRUPT_CHECKPOINTS)
config_file = _in_run(CONFIG)
metrics_file = _in_run(METRICS)
summary_file = _in_run(SUMMARY)
tensorboard = _in_run(TENSORBOARD)
wandb_id_file = _in_run(WANDB_ID)
lock_file = _in_run(LOCK)
history = _in_run(HISTORY)
wall_file = _in_run(WALL)


def run_of_checkpoint(path):
  """(run directory, step) when `path` is RUN/checkpoints/<step>, else (path, None)."""
  name = os.path.basename(os.path.normpath(path))
  parent = os.path.dirname(os.path.normpath(path))
  if name.isdigit() and os.path.basename(parent) == CHECKPOINTS:
    return os.path.dirname(parent), int(name)
  return path, None


def is_run_or_checkpoint(path):
  """True when `path` is a run directory (it has checkpoints/) or one of its
  checkpoints (checkpointing.is_checkpoint)."""
  return os.path.isdir(checkpoints(path)) or checkpointing.is_checkpoint(path)


# ---------------------------------------------------------------------------
# The saved config.


def check_config(saved, where):
  """`saved` when it is a config the trainer wrote (records.RunConfig);
  records.RecordError naming `where` and the first field that is not."""
  return records.check(records.RunConfig, saved, where)


def usable_config(saved):
  """True for a config dict as the trainer writes it (not `[]`, not {})."""
  try:
    check_config(saved, "config")
  except records.RecordError:
    return False
  return True


def saved_config(run):
  """(RUN/config.json's config, None) when it is usable (`usable_config`),
  else (None, what is wrong: "is missing", "cannot be read (...)", "is not a
  config written by fp4jax's trainer (...)")."""
  try:
    with open(config_file(run), encoding="utf-8") as f:
      saved = json.load(f)
  except FileNotFoundError:
    return None, "is missing"
  except (OSError, ValueError) as e:
    return None, f"cannot be read ({e})"
  if not usable_config(saved):
    return None, (f"is not a config written by fp4jax's trainer (it holds a "
                  f"{type(saved).__name__})")
  return saved, None


def checkpoint_config(run):
  """The config saved with the newest checkpoint of `run` that has a usable
  one (the checkpoint's JSON item keeps the run's resolved config under
  "config"), or None."""
  directory = checkpoints(run)
  for step in reversed(checkpointing.committed_steps(directory)):
    try:
      saved = checkpointing.data_item(directory, step, records.CheckpointData).get("config")
    except records.RecordError:
      continue  # an unusable one is set aside when the run restores
    if usable_config(saved):
      return saved
  return None


def recipe_name(run):
  """The recipe's name config.json records (resolved.recipe.name; None when
  the recipe has none); records.RecordError when there is no such block."""
  path = config_file(run)
  resolved = records.read(records.RunRecipe, path)["resolved"]
  return records.check(records.ResolvedRecipe, resolved, path)["recipe"].get("name")


# ---------------------------------------------------------------------------
# The other records.


def read_summary(run):
  """RUN/summary.json (records.Summary), or None before the run ended."""
  return records.read_if_present(records.Summary, summary_file(run))


def read_wall(run):
  """RUN/wall.json (records.Wall), or None before the ablation's first
  attempt at the run ended."""
  return records.read_if_present(records.Wall, wall_file(run))
