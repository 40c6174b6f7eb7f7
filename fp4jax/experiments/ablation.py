"""The staged ablation of arXiv 2605.09825 as one command.

  python -m fp4jax.experiments.ablation --config=configs/ablation_tiny.py \\
      --workdir=runs/ablation [--results=results/ablation --git_commit]

trains the same model on the same data with the same seed once per recipe in
`config.ablation.recipes` (each in WORKDIR/<recipe>, or WORKDIR/<recipe>_seed<N>
with several seeds), with the diagnostics callback of fp4jax.diagnostics on
chosen layers, then writes WORKDIR/table.md, curves.png and the diagnostics
figures (fp4jax.experiments.report). Finished runs are skipped; an interrupted
one resumes from its checkpoint, so the command can simply be run again.

--results=FOLDER: each run's records are copied into FOLDER/<run> as it
finishes (fp4jax.experiments.committed), runs complete there are skipped
(the study resumes from what is in git, the workdir may be gone), and the
report is written in FOLDER; --git_commit commits each finished run's folder
(and the declaration record) on its own, nothing else. A FOLDER/<run> that
is, holds or lies inside a run (FOLDER = WORKDIR, or inside a run), is a
symbolic link, or holds anything but what the study publishes there
(`is_published_records`), is refused before anything is written
(run_layout.check_output). The study folder (FOLDER, else WORKDIR) is
written only when it is the study's own (`is_study_folder`: it holds the
study's record) or holds none of the files a study writes at its top
(STUDY_FILES: a folder of the user's notes and a DECLARATION.json is
fine); any of them that is a symbolic link is refused too. Paths are taken
as the OS resolves them (`link/..` is the folder above the link's target).

A study folder belongs to the config recorded in its ablation_config.json
(never replaced); a rerun with another config, or finished runs trained with
another, is refused naming the keys (fp4jax.experiments.study_config), or
with --new_runs_beside trains in FOLDER/config-<hash>.

Config: a trainer config (fp4jax.train.config.base_config) plus
  ablation.recipes       comma-separated preset names (DEFAULT_RECIPES)
  ablation.arms          instead of recipes: named arms separated by ";",
                         NAME=PRESET:KEY=VALUE,... (fp4jax.experiments.arms);
                         the run folders and the report use the arm names
  ablation.declaration   the study's declaration file (fp4jax.experiments.declaration):
                         its hash is recorded in the results folder (or WORKDIR)
                         before the first run; a changed one is refused, and so
                         is one first recorded after runs finished; "" = the
                         folder's DECLARATION.json if present (for the report), else
                         no verdicts
  ablation.seeds         runs per recipe, seeds config.seed, config.seed + 1, ...
  ablation.recipe_seeds  fewer seeds for some recipes or arms, e.g. "bf16:2,A3:2"
                         (each runs the first N of the seeds)
  ablation.late_from     the token multiplier uses evaluations after this
                         fraction of the tokens
  ablation.compilation_cache  JAX's persistent compilation cache directory,
                         shared by all runs and reruns ("" = off)
  ablation.cpus_per_run  cores each run's process is pinned to (1); a run's bits
                         depend on it (XLA's CPU thread pool is that large), so a
                         study records it. 0: one run at a time in this process,
                         on every core
  ablation.parallel      runs side by side (0: as many as fit the cores, 2 on a
                         2-core machine: 1.43x the runs per hour of one run on both
                         cores, docs/studies/method.md); not part of a study's config
  ablation.executor      "" (default): the runs are processes of this machine, as
                         above; "auto", "slurm" or "local": each run a job of a
                         scheduler, through submitit (fp4jax.experiments.cluster:
                         `pip install fp4jax[cluster]`), on cpus_per_run cores
                         (0: all of the submitting machine's count), at most
                         `parallel` at once (0: on Slurm all, locally as many as
                         fit the cores); logs in WORKDIR/.submitit. Not part of a
                         study's config
  ablation.executor_params  submitit parameters "KEY=VALUE,...", e.g.
                         "timeout_min=240,slurm_partition=gpu,gpus_per_node=1"
  ablation.baseline      recipe whose final validation loss is the target ("fp8")
  ablation.target_at     the target is the baseline's validation loss at this
                         fraction of its tokens (1.0: its final loss)
  ablation.target_loss   the target instead, if set
  ablation.diverge_loss  a run ending above it is diverged (None: halfway
                         between the baseline's initial and final loss)
  ablation.zoom          share of the tokens the zoomed panel of curves.png shows
  diagnostics.enabled, .layers (comma-separated module paths; "" = first block's
  q and last block's down), .every, .window, .ref_batch_size (0 = batch_size).
The runs ignore config.target_eval_loss (every run uses its whole budget).
Runs go seed by seed (every recipe of seed 0, then of seed 1, ...), so an
interrupted ablation still holds complete pairs.
"""

import copy
import json
import os
import signal
import sys
import time

from fp4jax import errors  # pylint: disable=g-bad-import-order

if __name__ == "__main__":  # before the heavy imports: see errors.exit_on_signals
  errors.exit_on_signals("python -m fp4jax.experiments.ablation")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
from ml_collections import config_dict
from ml_collections import config_flags

from fp4jax.train import atomic
from fp4jax.train import cli
from fp4jax.data import pipeline
from fp4jax.data import tokenizers
from fp4jax import diagnostics
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax import recipes as recipes_lib
from fp4jax.train import config as train_config
from fp4jax.train import run_layout
from fp4jax.train import step as train_step
from fp4jax.train import trainer
from fp4jax.train import workdir as workdir_lib
from fp4jax.experiments import arms as arms_lib
from fp4jax.experiments import cluster
from fp4jax.experiments import code_version
from fp4jax.experiments import committed
from fp4jax.experiments import declaration
from fp4jax.experiments import parallel
from fp4jax.experiments import report
from fp4jax.experiments import study_config
# pylint: enable=g-import-not-at-top,wrong-import-position

ARMS = "arms.json"
# What a study writes at the top of its folder (each run's folder aside).
STUDY_FILES = (study_config.RECORD, declaration.RECORD, ARMS) + report.REPORT_FILES
# What a published run's folder holds: its records (committed.publish) and
# the report's figure.
PUBLISHED_FILES = committed.RUN_FILES + (committed.MANIFEST, report.DIAGNOSTICS)

DEFAULT_RECIPES = ("bf16", "fp8", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4", "mxfp4-sr",
                   "mxfp4-rh16", "mxfp4-dh16", "mxfp4-floor", "mxfp4-dh16-floor",
                   "mxfp4-wdh16", "mxfp4-lh16", "mxfp4-dh32")
_OWN_KEYS = ("ablation", "diagnostics")


def ablation_config() -> ml_collections.ConfigDict:
  """Defaults of the `ablation` block (see the module docstring)."""
  return ml_collections.ConfigDict(dict(
      recipes=",".join(DEFAULT_RECIPES), seeds=1, recipe_seeds="", baseline="fp8",
      arms="", declaration="",
      target_loss=config_dict.placeholder(float), target_at=1.0,
      diverge_loss=config_dict.placeholder(float), zoom=0.5, late_from=0.5,
      compilation_cache="~/.cache/fp4jax/jax", parallel=0, cpus_per_run=1,
      executor="", executor_params=""))


def diagnostics_config() -> ml_collections.ConfigDict:
  """Defaults of the `diagnostics` block (see the module docstring)."""
  return ml_collections.ConfigDict(dict(
      enabled=True, layers="", every=50, window=4, ref_batch_size=0))


def arm_list(config) -> list[arms_lib.Arm]:
  """The arms of config.ablation.arms, else one per preset of .recipes;
  unknown names or bad overrides raise ConfigError."""
  if config.ablation.arms.strip():
    out = arms_lib.parse_arms(config.ablation.arms)
  else:
    names = [n.strip() for n in config.ablation.recipes.split(",") if n.strip()]
    if not names:
      raise train_config.ConfigError("config.ablation.recipes is empty")
    for name in names:
      try:
        recipes_lib.recipe(name)
      except ValueError as e:
        raise train_config.ConfigError(f"config.ablation.recipes: {e}") from None
    out = [arms_lib.Arm(name, name, name) for name in names]
  names = [a.name for a in out]
  if config.ablation.target_loss is None and config.ablation.baseline not in names:
    raise train_config.ConfigError(f"the baseline {config.ablation.baseline!r} is not among the recipes "
                     f"{names}; add it or set config.ablation.target_loss")
  return out


def seed_counts(config, names) -> dict:
  """{recipe: number of seeds}: config.ablation.seeds, or its recipe_seeds entry.

  Entries for presets not among `names` are ignored (the recipe list was
  narrowed); names neither among `names` nor presets raise ValueError.
  """
  counts = {name: config.ablation.seeds for name in names}
  for item in filter(None, (i.strip() for i in config.ablation.recipe_seeds.split(","))):
    name, sep, count = (x.strip() for x in item.partition(":"))
    if not sep or not count.isdigit():
      raise ValueError(f"config.ablation.recipe_seeds entry {item!r} must be RECIPE:N with "
                       "N a positive integer, e.g. 'bf16:2'")
    if name not in counts:
      recipes_lib.recipe(name)
    else:
      counts[name] = min(int(count), config.ablation.seeds)
  if min(counts.values()) < 1:
    raise ValueError(f"every recipe needs >= 1 seed, got {counts}")
  return counts


def run_config(config, recipe, seed) -> ml_collections.ConfigDict:
  """The trainer config of one run: `config` without the ablation's own blocks.

  recipe: a preset name or an arms.Arm (its preset and overrides on config.quant).
  With diagnostics on, blocks stay unscanned on GPUs (the trainer scans there by default).
  """
  cfg = copy.deepcopy(config)
  with cfg.unlocked():
    for key in _OWN_KEYS:
      if key in cfg:
        del cfg[key]
  if isinstance(recipe, arms_lib.Arm):
    recipe.apply(cfg.quant)
  else:
    cfg.quant.name = recipe
  cfg.seed = seed
  cfg.target_eval_loss = None
  if (config.diagnostics.enabled and cfg.model.get("scan_layers") is None
      and jax.default_backend() == "gpu"):
    cfg.model.scan_layers = False  # diagnostics read each block's module path
  return cfg


def diagnostics_callback(config, cfg):
  """The fp4jax.diagnostics callback for the run config `cfg` (None if disabled)."""
  diag = config.diagnostics
  if not diag.enabled:
    return None
  tokenizer = tokenizers.make_tokenizer(cfg.data.tokenizer)
  model_cfg, recipe = train_config.resolve(cfg, tokenizer)
  ref_batch = pipeline.validation_windows(
      cfg.data, tokenizer, seq_len=cfg.seq_len,
      batch_size=diag.ref_batch_size or cfg.batch_size, num_batches=1)[0]
  layers = ([n.strip() for n in diag.layers.split(",") if n.strip()]
            or linears.diagnostics_layers(model_cfg))
  return diagnostics.make_callback(
      model_lib.Llama(model_cfg, recipe), ref_batch, layers=layers,
      every=diag.every, window=diag.window, seed=cfg.seed,
      layer_key=train_step.layer_key(jax.random.key(cfg.seed)))


def _status(path):
  summary = run_layout.read_summary(path)
  return summary and summary["status"]


def _add_wall(path, seconds, made_by):
  """Adds `seconds` to WORKDIR/<run>/wall.json (wall time over all attempts)
  and records `made_by` (code_version.current) there, its environment added
  to those of the earlier attempts."""
  os.makedirs(path, exist_ok=True)  # a run that failed at start made none
  saved = run_layout.read_wall(path) or {"wall_s": 0.0}
  made_by = dict(made_by)
  environments = list(saved.get("environments") or [])
  if made_by["environment"] not in environments:
    environments.append(made_by["environment"])
  del made_by["environment"]
  atomic.write_text(run_layout.wall_file(path), json.dumps(
      {"wall_s": saved["wall_s"] + seconds, **made_by, "environments": environments}))


def _run_cpus(config):
  """The cores each run's process has: cpus_per_run, or all (0)."""
  return config.ablation.cpus_per_run or len(os.sched_getaffinity(0))


def run_ablation(config, workdir, results=None, git_commit=False,
                 new_runs_beside=False) -> list:
  """Runs (or resumes) every run of the ablation, then writes the report; returns its rows.

  results: None, or the folder that receives each finished run's records
  (committed.publish) and the report; runs complete there are skipped.
  git_commit: commit each published run folder (results only).
  A study folder (results, else workdir) or a finished run of another config
  is refused (UserError naming the keys) before anything runs, unless
  new_runs_beside: then this config's study runs in FOLDER/config-<hash>
  (fp4jax.experiments.study_config), the old runs left as they are.
  """
  arms = arm_list(config)
  names = [a.name for a in arms]
  workdir = run_layout.output_path(workdir, "--workdir")
  results = results and run_layout.output_path(results, "--results")
  if config.ablation.seeds < 1:
    raise train_config.ConfigError(
        f"config.ablation.seeds must be >= 1, got {config.ablation.seeds}")
  if git_commit and not results:
    raise train_config.ConfigError("--git_commit needs --results=FOLDER (what it commits)")
  _check_before_recording(config, arms[0])
  counts = seed_counts(config, names)
  seeds = [config.seed + i for i in range(config.ablation.seeds)]
  runs = [(arm, seed, report.run_dir(workdir, arm.name, seed, len(seeds)))
          for i, seed in enumerate(seeds) for arm in arms if i < counts[arm.name]]
  out = results or workdir
  if results:  # each run's published folder replaces none of a run's
    for _, _, path in runs:
      run_layout.check_output(
          _results_dir(results, path), "--results run folder",
          reads=[p for _, _, p in runs], reading="trains a run in",
          is_own=is_published_records, own=(
              "a run's published records (only " + ", ".join(PUBLISHED_FILES) + ")"))
  check_study_folder(out, "--results folder" if results else "--workdir")
  if git_commit:  # before anything is written or trained
    committed.check_repository([results] + ([config.ablation.declaration]
                                            if config.ablation.declaration else []))
  workdir_lib.prepare(workdir, "--workdir")
  workdir_lib.prepare(out, "--results folder" if results else "--workdir")
  diffs = _other_config(config, workdir, results, runs)
  if diffs and not new_runs_beside:
    if study_config.runs_begun(workdir) + study_config.runs_begun(out):
      what = (f"{out!r} holds a study run with another config ({diffs}); its runs are not "
              "reused for this one. Rerun the config they were trained with")
    else:
      what = (f"{out!r} holds the record of another config ({diffs}), and no run of it "
              "began (an earlier start stopped before its first run): remove that "
              f"{study_config.RECORD} to start this config in its place")
    raise errors.UserError(
        f"{what}, give another --results / --workdir, or pass --new_runs_beside to train "
        f"this config's runs in {study_config.beside(out, config)}")
  if diffs:
    beside = study_config.beside(out, config)
    print(f"ablation: {out} holds a study run with another config ({diffs}); this "
          f"config's runs go to {beside}", flush=True)
    return run_ablation(config, study_config.beside(workdir, config),
                        results and beside, git_commit)
  if config.ablation.declaration:
    _record_declaration(config.ablation.declaration, out, [p for _, _, p in runs], results,
                        git_commit)
  for folder in {workdir, out}:
    study_config.record(folder, config)
    workdir_lib.write_json(os.path.join(folder, ARMS), {
        a.name: dict(spec=a.spec, recipe=a.recipe.name) for a in arms})
  todo = []
  for arm, seed, path in runs:
    if _published(results, path):
      print(f"ablation: {_published(results, path)} complete in the results, skipped", flush=True)
    elif _status(path) not in (None, "interrupted"):
      print(f"ablation: {path} already {_status(path)}, skipped", flush=True)
      _publish(results, git_commit, arm, seed, path)
    else:
      todo.append((arm, seed, path))
  if todo and not _train_all(config, todo, results, git_commit):
    return []
  rows = _report(config, out, names)
  if git_commit:
    committed.git_commit([results], f"{results}: report")
  return rows


def is_published_records(path):
  """True for a folder that holds nothing but what the study publishes in a
  run's folder (PUBLISHED_FILES, plain files)."""
  names = os.listdir(path)
  return set(names) <= set(PUBLISHED_FILES) and not any(
      os.path.islink(os.path.join(path, n)) or os.path.isdir(os.path.join(path, n))
      for n in names)


def is_study_folder(folder):
  """True when `folder` holds a study's record (its ablation_config.json, the
  declaration record a declared study writes before it, or the arms.json a
  study writes: {arm: {"spec": ..., "recipe": ...}}): the study's own."""
  if any(os.path.isfile(os.path.join(folder, n))
         for n in (study_config.RECORD, declaration.RECORD)):
    return True
  try:
    with open(os.path.join(folder, ARMS), encoding="utf-8") as f:
      arms = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(arms, dict) and bool(arms) and all(
      isinstance(a, dict) and set(a) == {"spec", "recipe"} for a in arms.values())


def check_study_folder(folder, what):
  """UserError (one line) before anything is written, when the study folder
  `folder` holds one of STUDY_FILES as a symbolic link or a folder, or is not
  a study's own (`is_study_folder`) and holds one of them: a study writes
  over only its own files."""
  if not os.path.isdir(folder):
    return
  run_layout.check_files_written([os.path.join(folder, n) for n in STUDY_FILES],
                                 "the study")
  if is_study_folder(folder):
    return
  theirs = [n for n in STUDY_FILES if os.path.exists(os.path.join(folder, n))]
  if theirs:
    raise errors.UserError(
        f"{what} {folder!r} holds {theirs[0]} but is not a study's folder (it has no "
        f"{study_config.RECORD}, {declaration.RECORD} or a study's {ARMS}); a study writes over only its own files: give an empty "
        "or new folder, or the study's own")


def _check_before_recording(config, arm):
  """The start-up checks that need no data (the run slots, the trainer's own
  keys): a study refused by them leaves no record behind (ConfigError)."""
  if config.ablation.executor:  # a scheduler's cores, not this machine's
    cluster.check(config.ablation.executor, config.ablation.executor_params)
  else:
    parallel.slots(config.ablation.parallel, config.ablation.cpus_per_run)
  try:
    train_config.check(run_config(config, arm, config.seed))
  except ValueError as e:
    raise train_config.ConfigError(f"bad config: {e}") from None


def _other_config(config, workdir, results, runs) -> str:
  """"" when the study folders' records and every finished run belong to
  `config`, else the differences shown (study_config)."""
  for folder in dict.fromkeys([workdir, results or workdir]):
    diffs = study_config.study_differences(folder, config)
    if diffs:
      return f"{os.path.join(folder, study_config.RECORD)}: {study_config.shown(diffs)}"
  for arm, seed, path in runs:
    done = _published(results, path) or (
        path if _status(path) in committed.FINISHED else None)
    if not done:
      continue
    diffs = study_config.run_differences(done, run_config(config, arm, seed))
    if diffs is None:
      return f"its finished run {done} has no config.json the trainer wrote"
    if diffs:
      return f"its finished run {done}: {study_config.shown(diffs)}"
    made = code_version.mismatch(run_layout.read_wall(done) or {},
                                 code_version.current(_run_cpus(config)))
    if made:
      return f"its finished run {done} was made by other code or cores: {made}"
  return ""


def _record_declaration(path, folder, run_paths, results, git_commit):
  """Records the declaration `path` in `folder` before the study's first run;
  UserError when it changed since, or when runs finished before any record."""
  state = declaration.status(folder, path)
  if state == "changed":
    raise errors.UserError(
        f"the declaration {path!r} changed after the study began (recorded in "
        f"{os.path.join(folder, declaration.RECORD)}); restore it (git checkout) or start a "
        "new study in another results folder")
  if state == "declared":
    return
  done = [os.path.basename(p) for p in run_paths
          if _status(p) in committed.FINISHED or _published(results, p)]
  if done:
    raise errors.UserError(
        f"the declaration {path!r} was not recorded before the first run ({len(done)} runs "
        f"finished: {', '.join(done[:3])}); a declared study starts with no finished runs")
  declaration.record(folder, path)
  if git_commit:
    committed.git_commit([os.path.join(folder, declaration.RECORD), path],
                         f"{folder}: declaration recorded before the first run")


def _published(results, path):
  """RESULTS/<run> when it holds the complete records of run `path`, else None."""
  if not results:
    return None
  dst = _results_dir(results, path)
  return dst if committed.is_complete(dst) else None


def _results_dir(results, path):
  """RESULTS/<run>: where the run `path` is published."""
  return os.path.join(results, os.path.basename(path))


def _publish(results, git_commit, arm, seed, path):
  """Copies the finished run `path` into RESULTS/<run> (and commits it)."""
  if results:
    dst = committed.publish(path, _results_dir(results, path))
    if git_commit:
      committed.git_commit([dst], f"{dst}: {arm.name} seed {seed} finished")


def _train_all(config, todo, results, git_commit) -> bool:
  """Trains the runs `todo` [(arm, seed, path)], publishing each as it finishes,
  side by side as config.ablation.parallel / cpus_per_run say
  (fp4jax.experiments.parallel); False when a signal or a run's own stop
  interrupted them (a checkpoint saved: the same command resumes)."""
  ab = config.ablation
  run_slots = None if ab.executor else parallel.slots(ab.parallel, ab.cpus_per_run)
  if run_slots == [None]:
    _use_compilation_cache(config)
    for arm, seed, path in todo:
      summary = _train(config, arm, seed, path)
      if summary["status"] == "interrupted":
        print(f"ablation: interrupted ({summary['message']}; a checkpoint was saved); "
              "run the same command again to resume", flush=True)
        return False
      _publish(results, git_commit, arm, seed, path)
    return True
  if not ab.executor:
    print(f"ablation: {len(todo)} runs, {len(run_slots)} at a time, each in its own process "
          f"on {ab.cpus_per_run} core(s) ({', '.join(map(str, run_slots))})", flush=True)
  failed, stopped, exited = [], [], []

  def on_end(job, exitcode):
    arm, seed, path = job[1:4]
    status = _status(path)
    if exitcode == 0 and status in committed.FINISHED:
      _publish(results, git_commit, arm, seed, path)
    elif status == "interrupted":
      stopped.append(path)
    elif exitcode < 0:
      failed.append(f"{path} ({_killed_by(-exitcode)})")
    else:
      failed.append(f"{path} (exit code {exitcode})")
      exited.append(path)

  jobs = [(config, arm, seed, path, logging.get_verbosity()) for arm, seed, path in todo]
  if ab.executor:
    signal_name = _train_as_jobs(config, jobs, on_end)
  else:
    signal_name = parallel.run(jobs, run_slots, _train_in_child, on_end)
  if failed:
    printed = "; the errors of those with an exit code are printed above" if exited else ""
    raise errors.UserError(f"{len(failed)} runs failed: {', '.join(failed)}{printed}; the "
                           "finished runs are kept")
  if signal_name or stopped:
    print(f"ablation: interrupted ({signal_name or 'a run stopped'}; {len(stopped)} runs "
          "saved a checkpoint); run the same command again to resume", flush=True)
    return False
  return True


def _train_as_jobs(config, jobs, on_end):
  """parallel.run's contract with each run a job of config.ablation.executor
  (fp4jax.experiments.cluster), pinned to cpus_per_run cores, at most
  `parallel` at once (0: on Slurm all, on this machine as many as fit its cores)."""
  ab = config.ablation
  cpus = ab.cpus_per_run or len(os.sched_getaffinity(0))
  workdir = os.path.dirname(jobs[0][3])
  ex = cluster.executor(ab.executor, os.path.join(workdir, ".submitit"), cpus,
                        ab.executor_params)
  fit = max(1, len(os.sched_getaffinity(0)) // cpus)
  in_flight = ab.parallel or (None if ex.cluster == "slurm" else fit)
  print(f"ablation: {len(jobs)} runs as {ex.cluster} jobs, "
        f"{in_flight or 'all'} at a time, each on {cpus} core(s); logs in "
        f"{os.path.join(workdir, '.submitit')}", flush=True)
  return cluster.run([(cpus, _train_in_child) + job for job in jobs], cluster.pinned,
                     lambda job, code: on_end(job[2:], code), ex, in_flight)


def _killed_by(signum):
  """Why a run killed by signal `signum` printed no error, in words."""
  try:
    name = signal.Signals(signum).name
  except ValueError:
    name = f"signal {signum}"
  oom = "; the kernel's out-of-memory killer sends SIGKILL" if name == "SIGKILL" else ""
  return f"killed by {name}, so it printed no error{oom}"


def _use_compilation_cache(config):
  """JAX's persistent cache in ablation.compilation_cache/cpus<N>: one per core
  count, as XLA splits a program's loops for the cores it was compiled with."""
  if config.ablation.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", os.path.join(
        os.path.expanduser(config.ablation.compilation_cache),
        f"cpus{len(os.sched_getaffinity(0))}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _train_in_child(config, arm, seed, path, verbosity):
  """_train in a child process of parallel.run, set up as this process is."""
  logging.set_verbosity(verbosity)
  _use_compilation_cache(config)
  try:
    _train(config, arm, seed, path)
  except errors.UserError as e:
    sys.exit(errors.report(_PROG, e))


def _train(config, arm, seed, path):
  made_by = code_version.current(len(os.sched_getaffinity(0)))
  differs = code_version.mismatch(run_layout.read_wall(path) or {}, made_by)
  if differs:
    raise errors.UserError(
        f"the interrupted run {path} was begun with other code or cores ({differs}); a "
        "run is made by one code version on one core count: remove the folder to "
        "train it anew, or resume it as it was begun")
  moved = code_version.environment_changes(run_layout.read_wall(path) or {}, made_by)
  if moved:
    print(f"ablation: {path} was begun in another environment ({moved}); resumed here, "
          "its wall.json lists both", flush=True)
  cfg = run_config(config, arm, seed)
  try:
    callback = diagnostics_callback(config, cfg)
  except (ValueError, FileNotFoundError) as e:  # as the trainer's start-up checks
    raise train_config.ConfigError(f"bad config: {e}") from e
  print(f"ablation: training {arm.name} (seed {seed}) in {path}", flush=True)
  t0 = time.time()
  try:
    return trainer.train(cfg, path, callbacks=[callback] if callback else [])
  finally:
    _add_wall(path, time.time() - t0, made_by)


def _report(config, workdir, names):
  ab = config.ablation
  rows = report.write_report(
      workdir, names, baseline=ab.baseline, target=ab.target_loss,
      diverge_loss=ab.diverge_loss, zoom=ab.zoom, target_at=ab.target_at,
      late_from=ab.late_from, declaration=ab.declaration or None,
      window=config.diagnostics.window if config.diagnostics.enabled else None)
  with open(os.path.join(workdir, report.TABLE)) as f:
    print(f.read(), flush=True)
  return rows


def main(argv):
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  if config is None or workdir is None:
    return errors.report(_PROG, "--config and --workdir are required, e.g. "
                         "--config=configs/ablation_tiny.py --workdir=runs/ablation")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    run_ablation(config, workdir, flags.FLAGS.results, flags.FLAGS.git_commit,
                 flags.FLAGS.new_runs_beside)
  except errors.UserError as e:
    return errors.report(_PROG, e)
  return 0


_PROG = "python -m fp4jax.experiments.ablation"

if __name__ == "__main__":
  try:
    cli.check_config_overrides(sys.argv)
  except errors.UserError as e:
    sys.exit(errors.report(_PROG, e))
  # Flags are defined here, not at import: config files import this module.
  config_flags.DEFINE_config_file("config", None, "ablation config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "directory of the ablation's runs")
  flags.DEFINE_string("results", None, "folder (kept in git) that receives each finished "
                      "run's records and the report; runs complete there are skipped")
  flags.DEFINE_boolean("git_commit", False, "commit each finished run's folder of --results")
  flags.DEFINE_boolean("new_runs_beside", False, "when the folders hold a study of another "
                       "config, train this config's runs in FOLDER/config-<hash> beside it")
  app.run(main, flags_parser=cli.flags_parser(_PROG))
