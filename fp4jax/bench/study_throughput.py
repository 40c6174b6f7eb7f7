"""Runs per hour of a study on this CPU: one run at a time on every core vs runs side by side.

  python -m fp4jax.bench study_throughput --config=configs/sr_bias_tiny.py \
      --arm S1 --runs 2 --steps 250 [--out R.json]

Trains the same `--runs` runs (seeds 0, 1, ... of one arm, `--steps` steps
each; the config's evaluations, diagnostics and checkpoints; no compilation
cache, so every run compiles its programs) through the
ablation runner twice, each time in a fresh workdir: "one at a time" with
cpus_per_run=0 (each run in this process, on every core) and "side by
side" with the runner's default (cpus_per_run=1, as many at once as there
are cores). Prints each layout's wall seconds, runs per hour, median step
time after step 20 (or half the steps; the trainer's step_time_s,
compile excluded) and the
ratios side by side / one at a time; then whether the two layouts' runs
have the same bits (losses and evaluations of every row), and where they
first differ. Run it alone: the ratio is of the machine's whole capacity.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from fp4jax import bench
from fp4jax import errors
from fp4jax.experiments import ablation
from fp4jax.experiments import parallel
from fp4jax.train import cli
from fp4jax.train import run_layout

LAYOUTS = {"one at a time": dict(cpus_per_run=0, parallel=0),
           "side by side": dict(cpus_per_run=1, parallel=0)}
_COMPARED = ("loss", "grad_norm", "eval_loss")


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench study_throughput",
                              description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/sr_bias_tiny.py", help="an ablation config file")
  p.add_argument("--arm", default="", help="the arm (or recipe) to run; default: the baseline")
  p.add_argument("--runs", type=bench.positive_int, default=2, help="runs per layout (seeds 0, 1, ...)")
  p.add_argument("--steps", type=bench.positive_int, default=250, help="steps per run")
  p.add_argument("--out", default="", help="also write the measurements to this JSON file")
  return p


def _rows(path):
  with open(run_layout.metrics_file(path)) as f:
    return [json.loads(line) for line in f]


def first_difference(a, b):
  """(step, key, value a, value b) of the first compared value that differs, or None."""
  for row_a, row_b in zip(a, b):
    for key in _COMPARED:
      if key in row_a and row_a[key] != row_b.get(key):
        return row_a["step"], key, row_a[key], row_b.get(key)
  return None if len(a) == len(b) else (None, "rows", len(a), len(b))


def measure(config, workdir, layout):
  """Trains the study `config` in `workdir` laid out as LAYOUTS[layout]; returns its numbers."""
  with config.unlocked():
    config.ablation.update(LAYOUTS[layout])
  t0 = time.time()
  ablation.run_ablation(config, workdir)
  wall = time.time() - t0
  runs = sorted(d for d in os.listdir(workdir) if os.path.isfile(
      run_layout.metrics_file(os.path.join(workdir, d))))
  steps = [r["step_time_s"] for run in runs for r in _rows(os.path.join(workdir, run))
           if "step_time_s" in r and r["step"] > min(20, config.steps // 2)]
  return dict(wall_s=wall, runs=len(runs), runs_per_hour=3600 * len(runs) / wall,
              step_s=statistics.median(steps), run_dirs=runs)


def _refuse(message):
  print(f"study_throughput: {message}", file=sys.stderr)
  sys.exit(2)


def main(argv):
  args = parser().parse_args(argv)
  try:
    config = cli.load_config_file(args.config)
    arm = args.arm or config.ablation.baseline
    arms = [a for a in ablation.arm_list(config) if a.name == arm]
  except errors.UserError as e:
    _refuse(str(e))
  if not arms:
    _refuse(f"--arm {arm!r} is not an arm of {args.config} "
            f"({', '.join(a.name for a in ablation.arm_list(config))})")
  with config.unlocked():
    config.ablation.arms = arms[0].spec
    config.ablation.update(baseline=arm, seeds=args.runs, recipe_seeds="", declaration="")
    config.steps = args.steps
    config.ablation.compilation_cache = ""  # every run compiles: no layout inherits programs
  out, dirs = {}, {}
  with tempfile.TemporaryDirectory() as scratch:
    for layout in LAYOUTS:
      dirs[layout] = os.path.join(scratch, layout.replace(" ", "_"))
      out[layout] = measure(config, dirs[layout], layout)
    one, side = out["one at a time"], out["side by side"]
    first_run = {k: _rows(os.path.join(dirs[k], one["run_dirs"][0])) for k in LAYOUTS}
  diff = first_difference(*first_run.values())
  print(f"{args.runs} runs of {arm}, {args.steps} steps each, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f} at the end")
  for layout, m in out.items():
    print(f"  {layout:14s} {m['wall_s']:8.1f} s  {m['runs_per_hour']:6.2f} runs/h  "
          f"median step {m['step_s']:.4f} s")
  at_once = min(args.runs, len(parallel.slots(0, LAYOUTS["side by side"]["cpus_per_run"])))
  print(f"  side by side / one at a time: runs per hour x"
        f"{side['runs_per_hour'] / one['runs_per_hour']:.3f}; steady state (median steps, "
        f"{at_once} at once) x{at_once * one['step_s'] / side['step_s']:.3f}")
  for layout, rows in first_run.items():
    final = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
    print(f"  {layout}: {one['run_dirs'][0]} final validation loss {final:.4f}")
  print("  same bits in both layouts" if diff is None else
        f"  bits differ: first at step {diff[0]}, {diff[1]} {diff[2]!r} vs {diff[3]!r}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(config=args.config, arm=arm, steps=args.steps, layouts=out,
                     first_difference=diff, load_average=os.getloadavg()), f, indent=1)

