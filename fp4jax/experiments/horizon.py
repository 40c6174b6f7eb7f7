"""The long-horizon study (E1) beyond the declared primary statistic, and the stress screen (E2).

E1's primary statistic (the late mean of each contrast, Holm over its claims)
is the report's (fp4jax.experiments.report, .verdicts). Its second family:
  growth     per arm and seed, the least-squares slope of the validation loss
             against ln(step) over the evaluations at lo <= step <= hi; a
             contrast's weights applied to these slopes give the slope of the
             paired difference (same evaluation steps), in nats per e-fold of
             steps (> 0: the gap widens). `growth_section` judges the
             declaration's claims on it (verdicts.evaluate, Holm over them)
             with the declared smallest growth (the primary smallest effect
             spread over ln(hi / lo)); a diverged run counts by the
             declaration's rule, as for the primary statistic.
`operand_errors` gives an arm's Wgrad operand errors: the validity rule of a
contrast for "variation in time" needs its two arms at the same error size.
`snr_crossing` gives the first diagnostic window where an arm's Wgrad
snr_true (median) falls below sqrt(3) (exploratory: not a declared statistic);
the section marks it on each contrast's figure and compares the paired
difference before and after it.

E2 (`stress_outcome`, from a run's metrics.jsonl rows, logged every step):
the step of the first non-finite training loss, the count of skipped steps,
the first step whose loss exceeds the running minimum of the steps before it
by `nats` (finite losses only), and the final validation loss.

  python -m fp4jax.experiments.horizon e1 RESULTS      writes RESULTS/horizon.md
  python -m fp4jax.experiments.horizon stress RESULTS  (RESULTS/lr*/: one study
      per peak lr) writes RESULTS/table.md
"""

import dataclasses
import math
import os
import sys

import numpy as np

from fp4jax import diagnostics
from fp4jax import errors
from fp4jax import records
from fp4jax.experiments import declaration as declaration_lib
from fp4jax.experiments import figures
from fp4jax.experiments import hypothesis_tests
from fp4jax.experiments import report
from fp4jax.experiments import verdicts


def eval_curve(run):
  """(steps_T, loss_T) of a run's evaluations (report.Run rows), step 0 included."""
  evals = [(r["step"], r["eval_loss"]) for r in run.rows if r.get("eval_loss") is not None]
  return (np.array([s for s, _ in evals], np.float64), np.array([l for _, l in evals], np.float64))


def growth(steps_T, loss_T, lo, hi):
  """Slope of loss against ln(step) over lo <= step <= hi (nan with < 2 points)."""
  steps_T, loss_T = np.asarray(steps_T, np.float64), np.asarray(loss_T, np.float64)
  keep = steps_T <= hi
  if not keep.any() or steps_T[keep][-1] <= 0:
    return math.nan
  return hypothesis_tests.log_slope(steps_T[keep], loss_T[keep], lo / steps_T[keep][-1])


def _diag_points(runs, role, stats_, source="train"):
  """(stat, step, value) of every logged diagnostic of `role` named in
  `stats_`, over the runs' measured layers and steps."""
  for run in runs:
    for key, (steps, values) in figures.diag_series(run.rows).items():
      src, _, r, stat = figures.parse_key(key)
      if (src, r) == (source, role) and stat in stats_:
        yield from ((stat, step, value) for step, value in zip(steps.tolist(), values.tolist()))


def operand_errors(runs_of_arm, role="wgrad", source="train"):
  """{"lhs_err": mean, "rhs_err": mean} of a role's operand errors over an
  arm's runs, measured layers and steps (nan when not measured)."""
  values = {"lhs_err": [], "rhs_err": []}
  for stat, _, value in _diag_points(runs_of_arm, role, values, source):
    if math.isfinite(value):
      values[stat].append(value)
  return {k: float(np.mean(v)) if v else math.nan for k, v in values.items()}


def errors_match(a, b, tolerance=0.03) -> bool:
  """True when every operand error of a is within `tolerance` (relative) of b's."""
  return all(abs(a[k] - b[k]) <= tolerance * b[k] for k in b)


def snr_crossing(runs_of_arm, threshold=diagnostics.SNR_THRESHOLD, role="wgrad"):
  """First diagnostic window (its first step) at which the median of an arm's
  `role` snr_true values (over its measured layers, seeds and the window's
  consecutive steps) is below `threshold`; None if never or not measured. A
  median, because single values are often clipped to 0."""
  by_step = {}
  for _, step, value in _diag_points(runs_of_arm, role, ("snr_true",)):
    by_step.setdefault(step, []).append(value)
  windows = []
  for step in sorted(by_step):
    if windows and step == windows[-1][-1] + 1:
      windows[-1].append(step)
    else:
      windows.append([step])
  for window in windows:
    if np.median([v for step in window for v in by_step[step]]) < threshold:
      return window[0]
  return None


def crossing_lines(crossings, curves, marks) -> list[str]:
  """Markdown (exploratory): each arm's snr_true crossing ({arm: step or None}),
  and per contrast the mean paired difference (curves: contrast_curves) at the
  evaluations before and from its mark (its arms' earliest crossing)."""
  shown = ", ".join(f"{a} {'never' if s is None else f'at step {s}'}"
                    for a, s in crossings.items())
  lines = [f"- Exploratory (not declared): the first diagnostic window where Wgrad snr_true "
           f"(median over layers, seeds and the window's steps) is below sqrt(3): {shown}. "
           "It is located no finer than the diagnostics' spacing."]
  for label, (steps, diff) in curves.items():
    cross = marks.get(label)
    if cross is None:
      continue
    mean = diff.mean(0)
    before, after = mean[(steps > 0) & (steps < cross)], mean[steps >= cross]
    text = lambda x: f"{x.mean():+.4f} ({x.size} evaluations)" if x.size else "none"
    lines.append(f"- {label}: mean paired difference before step {cross} {text(before)}, "
                 f"from it on {text(after)} (contrasts.png: dashed line).")
  return lines


def contrast_curves(runs, decl, diverged=frozenset()):
  """{contrast label: (steps_T, per-seed weighted difference [seeds, T])} on the
  evaluation steps every run of the contrast has; seeds where one of its runs
  diverged ((arm, seed) in `diverged`) are left out."""
  out = {}
  for claim in decl.claims:
    for c in claim.contrasts:
      if any(a not in runs for a in c.weights):
        continue
      by_arm = {a: {r.seed: dict(zip(*eval_curve(r))) for r in runs[a]
                    if (a, r.seed) not in diverged} for a in c.weights}
      seeds = sorted(set.intersection(*(set(v) for v in by_arm.values())))
      if not seeds:
        continue
      steps = sorted(set.intersection(*(set(by_arm[a][s]) for a in c.weights for s in seeds)))
      diff = [[sum(w * by_arm[a][s][t] for a, w in c.weights.items()) for t in steps]
              for s in seeds]
      out[c.label] = (np.array(steps, np.float64), np.array(diff, np.float64))
  return out


def validity_lines(runs, rule) -> list[str]:
  """Markdown: the declared validity rule ({"arms": [a, b], "tolerance": f,
  "role": "wgrad", "claim": label}) checked on the arms' operand errors."""
  a, b = rule["arms"]
  ea, eb = (operand_errors(runs.get(x, []), rule.get("role", "wgrad")) for x in (a, b))
  if any(not math.isfinite(v) for v in (*ea.values(), *eb.values())):
    return [f"- Validity of {rule['claim']}: not measured ({a} or {b} has no operand errors)."]
  ok = errors_match(ea, eb, rule["tolerance"])
  shown = "; ".join(f"{k} {ea[k]:.4f} vs {eb[k]:.4f} ({ea[k] / eb[k] - 1:+.1%})" for k in eb)
  return [f"- Validity of {rule['claim']}: {a} vs {b} {rule.get('role', 'wgrad')} operand "
          f"errors {shown}: " + (f"within {rule['tolerance']:.0%}, valid." if ok else
                                 f"NOT within {rule['tolerance']:.0%}: {rule['claim']} is "
                                 "CONFOUNDED by the error size.")]


def growth_section(workdir, path=None) -> list[str]:
  """Markdown: the declaration's claims judged on growth (see the module
  docstring), the validity rule, and RESULTS/contrasts.png."""
  path = path or os.path.join(workdir, "DECLARATION.json")
  decl = declaration_lib.load(path)
  raw = records.read(records.HorizonDeclaration, path)
  growth_ = records.check(records.Growth, raw["growth"], f"{path}: growth")
  for i, rule in enumerate(raw.get("validity") or []):
    records.check(records.ValidityRule, rule, f"{path}: validity[{i}]")
  lo, hi = growth_["from_step"], growth_["to_step"]
  runs = report.load_runs(workdir)
  slope, smallest = report.smallest_effect(runs, decl)
  smallest_growth = smallest / math.log(hi / lo)
  diverged = report.diverged_runs(runs)
  values = {arm: {r.seed: growth(*eval_curve(r), lo, hi) for r in rs} for arm, rs in runs.items()}
  values = {arm: {seed: g for seed, g in v.items()  # nan and not diverged: too few evaluations
                  if math.isfinite(g) or (arm, seed) in diverged} for arm, v in values.items()}
  results = verdicts.evaluate(decl, values, smallest_growth, set(diverged))
  curves = contrast_curves(runs, decl, set(diverged))
  crossings = {arm: snr_crossing(rs) for arm, rs in runs.items()}
  marks = {c.label: min((crossings[a] for a in c.weights if crossings.get(a) is not None),
                        default=None)
           for claim in decl.claims for c in claim.contrasts}
  figures.plot_contrasts(os.path.join(workdir, "contrasts.png"), curves, marks)
  state = declaration_lib.status(workdir, path)
  lines = ["", f"Growth (declared second family; declaration {state}): per arm and seed the "
           f"slope of the validation loss against ln(step) over steps {lo}-{hi}; a contrast "
           "of these slopes is the slope of its paired difference, in nats per e-fold of "
           f"steps. Smallest growth of interest: {smallest:.4f} nats (the primary smallest "
           f"effect, baseline slope {slope:.4f}) over ln({hi}/{lo}) = {smallest_growth:.4f}. "
           f"Holm over the {len(decl.claims)} claims as for the primary statistic. Figure: "
           "contrasts.png (seeds with a diverged run left out). "
           + report.diverged_note(decl, diverged), ""]
  lines += verdicts.lines(results, smallest_growth, decl.power)
  for rule in raw.get("validity") or []:
    lines += validity_lines(runs, rule)
  return lines + crossing_lines(crossings, curves, marks)


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


_COMMANDS = {"e1": (growth_section, "horizon.md"), "stress": (stress_table, "table.md")}


def main(argv):
  prog = "python -m fp4jax.experiments.horizon"
  if any(a in ("-h", "--help") for a in argv[1:]):
    print(f"usage: {prog} e1|stress RESULTS\n\n" + __doc__)
    return 0
  if len(argv) != 3 or argv[1] not in _COMMANDS or not os.path.isdir(argv[2]):
    return errors.report(prog, f"usage: {prog} e1|stress RESULTS (a results folder), got "
                         f"{' '.join(argv[1:])!r}")
  make, name = _COMMANDS[argv[1]]
  try:
    lines = make(argv[2])
  except errors.UserError as e:
    return errors.report(prog, e)
  with open(os.path.join(argv[2], name), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
