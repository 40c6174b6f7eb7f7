"""The statistics of the long-horizon study (E1) and the learning-rate stress screen (E2).

E1 compares arms in pairs, seed by seed, on their validation curves at the
same steps (`paired_difference`: arm a's eval loss minus arm b's). Per seed:
  late mean  the mean of the difference over evaluations at >= `from_step`;
  growth     the least-squares slope of the difference against ln(step) over
             [lo, hi] (nats per e-fold of steps; > 0: the gap widens).
The smallest effect of interest converts a token fraction into nats through
the baseline's own late slope: a recipe that needs (1 + f) x the tokens sits
-dL/dln(t) * ln(1 + f) above the baseline (`smallest_effect`).
`operand_errors` gives an arm's Wgrad operand errors (the validity rule:
two arms compared for "variation in time" need the same error size).

E2 (`stress_outcome`, from a run's metrics.jsonl rows, logged every step):
the step of the first non-finite training loss, the count of skipped steps,
the first step whose loss exceeds the running minimum of the steps before it
by `nats` (finite losses only), and the final validation loss.

  python -m fp4jax.experiments.horizon stress RESULTS  (RESULTS/lr*/: one study
      per peak lr) writes RESULTS/table.md.
"""

import dataclasses
import math
import os
import sys

import numpy as np

from fp4jax import errors
from fp4jax.experiments import plots
from fp4jax.experiments import report


def eval_curve(run):
  """(steps_T, loss_T) of a run's evaluations (report.Run rows), step 0 included."""
  evals = [(r["step"], r["eval_loss"]) for r in run.rows if r.get("eval_loss") is not None]
  return (np.array([s for s, _ in evals], np.float64), np.array([l for _, l in evals], np.float64))


def paired_difference(run_a, run_b):
  """(steps_T, diff_T): a's eval loss minus b's at the steps both evaluated."""
  sa, la = eval_curve(run_a)
  sb, lb = eval_curve(run_b)
  common, ia, ib = np.intersect1d(sa, sb, return_indices=True)
  return common, la[ia] - lb[ib]


def late_mean(steps_T, diff_T, from_step):
  """Mean of diff over the evaluations at step >= from_step (nan if none)."""
  keep = np.asarray(steps_T) >= from_step
  return float(np.mean(np.asarray(diff_T)[keep])) if keep.any() else math.nan


def growth(steps_T, diff_T, lo, hi):
  """Slope of diff against ln(step) over lo <= step <= hi (nan with < 2 points)."""
  steps_T, diff_T = np.asarray(steps_T, np.float64), np.asarray(diff_T, np.float64)
  keep = (steps_T >= lo) & (steps_T <= hi) & (steps_T > 0) & np.isfinite(diff_T)
  if keep.sum() < 2:
    return math.nan
  return float(np.polyfit(np.log(steps_T[keep]), diff_T[keep], 1)[0])


def smallest_effect(base_runs, fraction, from_step):
  """Nats of `fraction` more tokens: -dL/dln(step) of the baseline over its
  evaluations at >= from_step (mean over runs), times ln(1 + fraction)."""
  slopes = [growth(*eval_curve(r), from_step, math.inf) for r in base_runs]
  return float(-np.nanmean(slopes) * math.log1p(fraction))


def per_seed(runs, a, b, from_step, lo, hi):
  """{seed: (late mean, growth)} of arm a minus arm b ({arm: [report.Run]})."""
  base = {r.seed: r for r in runs.get(b, [])}
  out = {}
  for run in runs.get(a, []):
    if run.seed in base:
      steps, diff = paired_difference(run, base[run.seed])
      out[run.seed] = (late_mean(steps, diff, from_step), growth(steps, diff, lo, hi))
  return out


def operand_errors(runs_of_arm, role="wgrad", source="train"):
  """{"lhs_err": mean, "rhs_err": mean} of a role's operand errors over an
  arm's runs, measured layers and steps (nan when not measured)."""
  values = {"lhs_err": [], "rhs_err": []}
  for run in runs_of_arm:
    for key, (_, v) in plots.diag_series(run.rows).items():
      src, _, r, stat = plots.parse_key(key)
      if (src, r) == (source, role) and stat in values:
        values[stat].extend(v[np.isfinite(v)])
  return {k: float(np.mean(v)) if v else math.nan for k, v in values.items()}


def errors_match(a, b, tolerance=0.03) -> bool:
  """True when every operand error of a is within `tolerance` (relative) of b's."""
  return all(abs(a[k] - b[k]) <= tolerance * b[k] for k in b)


# ------------------------------------------------------------------ E2

@dataclasses.dataclass(frozen=True)
class StressOutcome:
  """E2's statistics of one run (None: did not happen)."""
  first_nonfinite: int | None
  skipped: int
  first_blowup: int | None
  final_eval_loss: float | None


def stress_outcome(rows, nats=1.0) -> StressOutcome:
  """StressOutcome of metrics.jsonl rows (training rows need every step logged)."""
  train = [r for r in rows if r.get("loss") is not None]
  nonfinite = [r["step"] for r in train if not math.isfinite(r["loss"])]
  blowup, best = None, math.inf
  for r in train:
    if not math.isfinite(r["loss"]):
      continue
    if r["loss"] > best + nats:
      blowup = r["step"]
      break
    best = min(best, r["loss"])
  evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
  return StressOutcome(nonfinite[0] if nonfinite else None,
                       max((int(r.get("skipped_steps") or 0) for r in train), default=0),
                       blowup, evals[-1] if evals else None)


def stress_table(results) -> list[str]:
  """Markdown lines: one row per peak lr (RESULTS/lr*/) and arm."""
  lines = ["| peak lr | arm | first non-finite loss (step) | skipped steps | "
           "first step > running min + 1 nat | final val loss | status |",
           "|---|---|---|---|---|---|---|"]
  folders = sorted((d for d in os.listdir(results) if d.startswith("lr")
                    and os.path.isdir(os.path.join(results, d))),
                   key=lambda d: float(d[2:]))
  if not folders:
    raise errors.UserError(f"no lr* folders under {results!r} (one study per peak lr)")
  show = lambda x: "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))
  for folder in folders:
    for arm, runs in report.load_runs(os.path.join(results, folder)).items():
      for run in runs:
        o = stress_outcome(run.rows)
        lines.append(f"| {folder[2:]} | {arm} | {show(o.first_nonfinite)} | {o.skipped} | "
                     f"{show(o.first_blowup)} | {show(o.final_eval_loss)} | "
                     f"{run.status or 'running'} |")
  return lines


def main(argv):
  prog = "python -m fp4jax.experiments.horizon"
  if len(argv) != 3 or argv[1] != "stress" or not os.path.isdir(argv[2]):
    return errors.report(prog, f"usage: {prog} stress RESULTS (a folder with lr* studies), "
                         f"got {argv[1:]}")
  try:
    lines = stress_table(argv[2])
  except errors.UserError as e:
    return errors.report(prog, e)
  with open(os.path.join(argv[2], "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
