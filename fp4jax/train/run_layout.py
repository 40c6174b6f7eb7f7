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

No command writes over a run: `check_output` refuses a folder a command would
fill or replace (an export, a study's results) when it is, holds or lies
inside a run or a checkpoint (a study's published run, metrics.jsonl beside
the trainer's config.json, counts), is a symbolic link, a file, the current
folder or one above it, or is some other folder than the command's own
kind; `check_output_file` refuses a file a command would write (a plot) that
is a symbolic link or lies inside a run or a checkpoint. Every command asks
first, before anything is written, with the path as the OS resolves it
(`output_path`: `link/..` is the folder above the link's target, never the
folder the text `link/..` would name).
"""

import json
import os

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic

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
# What no command writes over.


def _inside(path, folder):
  """True when the real path `path` is `folder` or lies inside it."""
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def output_path(path, what):
  """The output path `path` as the OS resolves it when it is written
  (atomic.resolved: `link/..` is the folder above the link's target);
  errors.UserError (one line naming `what`) for an empty path."""
  if not path:
    raise errors.UserError(f"{what} is empty; give the folder or file to write")
  return atomic.resolved(path)


def check_files_written(paths, who):
  """errors.UserError (one line) before anything is written when one of the
  files `paths` that `who` ("the study", "the report") writes is a symbolic
  link (it would write through it, over the file it points to) or a folder."""
  for path in paths:
    if os.path.islink(path):
      raise errors.UserError(
          f"{path!r} is a symbolic link to {os.readlink(path)!r}; {who} does not "
          "write through it: remove the link")
    if os.path.isdir(path):
      raise errors.UserError(f"{path!r} is a folder; {who} writes a file there: "
                             "move it, or give another folder")


def is_published_run(path):
  """True when `path` holds a run's records without its checkpoints, as a
  study publishes them: metrics.jsonl and a config.json the trainer wrote
  (`usable_config`)."""
  return os.path.isfile(metrics_file(path)) and saved_config(path)[0] is not None


def _is_run_above(path):
  """Whether the folder `path`, above an output, is a run or a checkpoint: a
  checkpoint, a folder whose checkpoints/ holds a checkpoint or that has
  metrics.jsonl beside its checkpoints/ or beside a config.json the trainer
  wrote (`is_published_run`). A folder that holds another tool's
  checkpoints/ or metrics.jsonl alone is not one."""
  return (checkpointing.is_checkpoint(path) or is_published_run(path) or (
      os.path.isdir(checkpoints(path)) and (
          checkpointing.committed_steps(checkpoints(path))
          or os.path.isfile(metrics_file(path)))))


def _run_of(path):
  """The run or checkpoint that the real path `path` is or lies inside, or
  None: `path` itself counts when it has checkpoints/ (`is_run_or_checkpoint`),
  it and the folders above it when they are a run by `_is_run_above`."""
  return path if is_run_or_checkpoint(path) else _run_above(path)


def _run_above(path):
  """The first of the real folder `path` and the folders above it that is a
  run by `_is_run_above`, or None."""
  while True:
    if _is_run_above(path):
      return path
    parent = os.path.dirname(path)
    if parent == path:
      return None
    path = parent


def holds_no_folder(path):
  """True when the folder `path` holds files only (what an export or a
  study's published run holds; a run holds checkpoints/)."""
  return not any(os.path.isdir(os.path.join(path, n)) for n in os.listdir(path))


def check_output(path, what, *, reads=(), reading="reads", is_own, own):
  """Refuses (errors.UserError, one line naming `what` `path`) a folder that
  a command is about to fill or replace, before anything is written:

  - a symbolic link (named with its target: replacing the link would leave
    the folder it points to, writing through it would replace that folder);
  - something that is not a folder;
  - the current folder or a folder above it (a command cannot replace it);
  - a folder that is or lies inside a run or a checkpoint (`_run_of`: a
    folder with checkpoints/, one checkpoint, or a run's records, e.g. a
    study's published run), or one of `reads` (the folders the command
    `reading`: "reads", "trains a run in"; they need not exist yet), or
    holds one of them; only a run's records that are `is_own(path)` (the
    ablation's own published run) may be replaced;
  - an existing folder that holds anything but is not `is_own(path)` (a
    function of the path; `own` says what that is, e.g. "an export"): the
    only folder a command replaces is one it wrote.

  A path that does not exist yet passes unless it would lie inside a run.
  `path` is used as the OS resolves it (give it through `output_path`).
  """
  if os.path.islink(path):
    raise errors.UserError(
        f"{what} {path!r} is a symbolic link to {os.readlink(path)!r}; it is not "
        "followed or replaced: give the folder itself, or another folder")
  if os.path.exists(path) and not os.path.isdir(path):
    raise errors.UserError(
        f"{what} {path!r} exists and is a file, not a folder; it is not replaced: "
        "move or remove it, or give another folder")
  real = os.path.realpath(path)
  cwd = os.path.realpath(os.getcwd())
  if _inside(cwd, real):
    how = "is the current folder" if cwd == real else "holds the current folder"
    raise errors.UserError(
        f"{what} {path!r} {how}, which a command cannot replace: give a new or "
        "other folder")
  for read in reads:
    read_real = os.path.realpath(read)
    if _inside(real, read_real) or _inside(read_real, real):
      how = ("is" if real == read_real else "lies inside" if _inside(real, read_real)
             else "holds")
      raise errors.UserError(
          f"{what} {path!r} {how} {read!r}, which this command {reading}; give a "
          "folder outside it")
  run = _run_of(real)
  if run is not None and not (run == real and not is_run_or_checkpoint(real)
                              and is_own(real)):
    shown = os.path.normpath(os.path.join(path, os.path.relpath(run, real)))
    how = "is" if run == real else (
        f"lies inside {shown if os.path.realpath(shown) == run else run!r},")
    raise errors.UserError(
        f"{what} {path!r} {how} a run or checkpoint; it is never written over: "
        "give a folder outside it")
  if not os.path.isdir(real) or not os.listdir(real):
    return
  held = [os.path.join(path, name) for name in sorted(os.listdir(real))
          if is_run_or_checkpoint(os.path.join(real, name))
          or is_published_run(os.path.join(real, name))]
  if held:
    raise errors.UserError(
        f"{what} {path!r} holds the run or checkpoint {held[0]!r}; it is never "
        "written over: give a folder outside it")
  if not is_own(real):
    raise errors.UserError(
        f"{what} {path!r} exists and is not {own}; only such a folder is replaced: "
        "give another folder")


def check_output_file(path, what):
  """Refuses (errors.UserError, one line) a file that a command is about to
  write or replace, before anything is written: a symbolic link (writing
  through it would replace the file it points to), a folder, or a path that
  is or lies inside a run or a checkpoint (`check_output`'s rule; a run's
  own files included). `path`: as `output_path` gives it."""
  if os.path.islink(path):
    raise errors.UserError(
        f"{what} {path!r} is a symbolic link to {os.readlink(path)!r}; it is not "
        "written through or replaced: give another file name")
  if os.path.isdir(path):
    raise errors.UserError(f"{what} {path!r} is a folder; give the name of a file")
  real = os.path.join(os.path.realpath(os.path.dirname(path) or os.curdir),
                      os.path.basename(path))
  run = _run_above(os.path.dirname(real))
  if run is not None:
    raise errors.UserError(
        f"{what} {path!r} lies inside the run or checkpoint {run!r}; it is never "
        "written over: give a file outside it")


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
