"""Which config a study's records belong to: the study's and each run's.

A study folder (the ablation's --results, else its workdir) keeps the config
it was started with in ablation_config.json (`record`), written once and
never replaced. `study_differences(folder, config)` compares a rerun's config with
it, and `run_differences(run_path, cfg)` a finished run's config.json with
the trainer config that run would get now: a run is only reused (skipped) by
a rerun of the config it was trained with. Keys that do not change what a
run records (where checkpoints go, the mesh, logging sinks, the compilation
cache, how many runs go side by side, the scheduler) are not compared, nor keys only one
side has (a key added to fp4jax since the study ran).

`beside(folder, config)` names where a rerun with another config puts its
runs instead (FOLDER/config-<hash of the config>/), leaving the old ones as
they are. `runs_begun(folder)` names the runs that began in a study folder:
a record no run began under (an earlier start stopped before its first run)
may be removed by hand, as the refusal says.
"""

import hashlib
import json
import os

from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import run_layout
from fp4jax.train import workdir as workdir_lib

RECORD = "ablation_config.json"
# Keys (and everything below them) that do not change a run's records.
NOT_COMPARED = ("checkpoint_every", "keep_checkpoints", "async_checkpointing",
                "mesh", "distributed", "quant.residuals", "profile",
                "peak_tflops", "wandb", "ablation.compilation_cache",
                "ablation.parallel", "ablation.executor", "ablation.executor_params")


def _plain(config):
  """A ConfigDict (or dict) as the JSON values it is recorded as."""
  tree = config.to_dict() if hasattr(config, "to_dict") else config
  return json.loads(json.dumps(tree, default=workdir_lib.json_default))


def _compared(key):
  return not any(key == k or key.startswith(k + ".") for k in NOT_COMPARED)


def differences(saved, asked):
  """[(key, saved value, asked value)] of the compared keys both dicts have
  whose values differ (dicts compared leaf by leaf)."""
  old, new = workdir_lib.flat(saved), workdir_lib.flat(asked)
  return [(k, old[k], new[k]) for k in sorted(old.keys() & new.keys())
          if _compared(k) and old[k] != new[k]]


def shown(diffs, limit=6):
  """"key: old -> new, ..." of at most `limit` differences."""
  text = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diffs[:limit])
  return text + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


def record(folder, config):
  """Writes FOLDER/ablation_config.json unless there is one (never replaced)."""
  path = os.path.join(folder, RECORD)
  if not os.path.exists(path):
    atomic.write_text(path, json.dumps(_plain(config), indent=2))


def study_differences(folder, config):
  """The differences of `config` from FOLDER/ablation_config.json ([] when
  there is none); UserError when it is not a config."""
  path = os.path.join(folder, RECORD)
  if not os.path.exists(path):
    return []
  return differences(records.read(records.StudyConfig, path), _plain(config))


def run_differences(run_path, cfg):
  """The differences of the trainer config `cfg` from the one the finished
  run in `run_path` was trained with (its config.json, "resolved" left
  out); None when that is missing or not a config the trainer wrote."""
  saved, problem = run_layout.saved_config(run_path)
  if problem:
    return None
  saved = {k: v for k, v in saved.items() if k != "resolved"}
  return differences(saved, _plain(cfg))


def beside(folder, config):
  """FOLDER/config-<first 8 hex digits of the config's SHA-256>."""
  text = json.dumps(_plain(config), sort_keys=True)
  return os.path.join(folder, "config-" + hashlib.sha256(
      text.encode()).hexdigest()[:8])


def runs_begun(folder) -> list:
  """The subfolders of `folder` where a run began (they hold a run's records
  or checkpoints), sorted; [] when there is no such folder."""
  if not os.path.isdir(folder):
    return []
  marks = run_layout.RECORDS + (run_layout.CHECKPOINTS,)
  return sorted(name for name in os.listdir(folder)
                if any(os.path.exists(os.path.join(folder, name, m)) for m in marks))
