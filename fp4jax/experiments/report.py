"""The ablation's outputs, read back from its run directories.

`load_runs` reads WORKDIR/<run>/metrics.jsonl (and summary.json, wall.json);
`summarize` turns the validation curves into the table's rows (tokens to
target, overhead, divergence, paired against the baseline of the same seed);
`write_report` writes table.md and the figures of fp4jax.experiments.figures;
the verdicts follow the study's declaration (fp4jax.experiments.declaration;
default WORKDIR/DECLARATION.json, the study folder's own), flagged
EXPLORATORY when it was not recorded before the first run or changed since.
`diverged_runs` names the runs that diverged; they count in the verdicts by
the declaration's rule (`diverged_note` says which, and names them).

`python -m fp4jax.experiments.report WORKDIR [--target=LOSS] [--target_at=F]
[--declaration=PATH]` redraws them from whatever runs have finished (or are
still going).
"""

import dataclasses
import json
import math
import os
import re
import sys

import numpy as np

from fp4jax import diagnostics
from fp4jax import errors
from fp4jax import records
from fp4jax.experiments import declaration as declaration_lib
from fp4jax.experiments import figures
from fp4jax.experiments import hypothesis_tests
from fp4jax.experiments import stats
from fp4jax.experiments import study_config
from fp4jax.experiments import tokens_to_target as ttt
from fp4jax.experiments import verdicts
from fp4jax.train import run_layout
from fp4jax.train.metrics_log import read_metrics

# Extra tokens vs FP8 to reach the target, Llama 3.1-8B on C4 (arXiv 2605.09825;
# docs/ablation.md, "What the paper did and claimed").
PAPER = {
    "bf16": "-", "fp8": "baseline", "mxfp4-fprop": "8-9% (?)",
    "mxfp4-fprop-dgrad": "10-11%", "mxfp4": "26-27%", "mxfp4-sr": "diverges",
    "mxfp4-rh16": "diverges", "mxfp4-dh16": "8-9%", "mxfp4-dh32": "8-9%",
}
SNR_STATS = ("snr", "snr_true")
TABLE, CURVES, SNR, DIAGNOSTICS = "table.md", "curves.png", "snr.png", "diagnostics.png"
# What the report writes in the study folder (and DIAGNOSTICS in each run's).
REPORT_FILES = (TABLE, CURVES, SNR, DIAGNOSTICS)
_SEED_DIR = re.compile(r"(.+)_seed(\d+)$")


@dataclasses.dataclass
class Run:
  """One training run of the ablation.

  tokens_T, loss_T: its validation curve; status: the trainer's summary
  status (None while running; "diverged" when it gave up on non-finite
  steps); wall_s: seconds the ablation spent on it; environments: those its
  attempts ran in (wall.json; None before they were recorded).
  """
  recipe: str
  seed: int
  path: str
  rows: list
  tokens_T: np.ndarray
  loss_T: np.ndarray
  status: str | None
  skipped_steps: int
  wall_s: float | None
  environments: list | None = None

  @property
  def finished(self) -> bool:
    return self.status not in (None, "interrupted")

  @property
  def final_loss(self) -> float:
    return float(self.loss_T[-1]) if self.loss_T.size else math.nan


def run_dir(workdir, recipe, seed, n_seeds):
  """WORKDIR/<recipe> for one seed, WORKDIR/<recipe>_seed<N> for several."""
  return os.path.join(workdir, recipe if n_seeds == 1 else f"{recipe}_seed{seed}")


def load_run(path, recipe, seed) -> Run | None:
  """The Run in `path` (metrics.jsonl, summary.json, wall.json), or None before its first row."""
  rows = read_metrics(path)
  if not rows:
    return None
  evals = [(r["tokens"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
  tokens_T = np.array([t for t, _ in evals], np.float64)
  loss_T = np.array([l for _, l in evals], np.float64)
  summary = run_layout.read_summary(path)
  wall = run_layout.read_wall(path)
  skipped = max(int(r.get("skipped_steps") or 0) for r in rows)
  return Run(recipe, seed, path, rows, tokens_T, loss_T, summary and summary["status"],
             skipped, wall and wall["wall_s"], wall and wall.get("environments"))


def load_runs(workdir, recipes=None) -> dict:
  """{recipe: [Run, ...]} for the run directories in `workdir` (in `recipes` order)."""
  found = {}
  for name in sorted(os.listdir(workdir)):
    path = os.path.join(workdir, name)
    if name.startswith(".") or not os.path.isfile(run_layout.metrics_file(path)):
      continue  # hidden: a results folder's copy in progress (committed.publish)
    match = _SEED_DIR.fullmatch(name)
    recipe, seed = (match.group(1), int(match.group(2))) if match else (name, None)
    run = load_run(path, recipe, seed)
    if run is not None:
      found.setdefault(recipe, []).append(run)
  order = list(recipes or []) + sorted(set(found) - set(recipes or []))
  return {r: found[r] for r in order if r in found}


@dataclasses.dataclass
class Row:
  """One recipe's line of the table: final_loss and delta_loss are (mean,
  spread) over its seeds; tokens and overhead the median over its seeds, a
  seed that never reached the target counted as never (None: undefined, half
  or more did not reach it; ttt.median_with_misses)."""
  recipe: str
  n: int
  final_loss: tuple
  delta_loss: tuple | None
  tokens: float | None
  reached: int
  overhead: float | None
  diverged: int
  skipped: int
  wall_s: float | None
  finished: int


def _mean_spread(values):
  values = np.asarray(values, np.float64)
  return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def target_note(baseline, target_given, target_at):
  """How the target was chosen, in words (for table.md)."""
  if target_given:
    return "set explicitly"
  if target_at == 1:
    return f"the final validation loss of the baseline `{baseline}`"
  return f"the validation loss of the baseline `{baseline}` at {target_at:.0%} of its tokens"


def summarize(runs, baseline="fp8", target=None, diverge_loss=None, target_at=1.0):
  """Table rows for {recipe: [Run]}; returns (rows, targets {seed: loss}, diverge_loss).

  Runs are compared with the baseline run of the same seed (same data order
  and initialisation). target: default, per seed, the baseline's validation
  loss at `target_at` of its tokens, interpolated (1.0: its final loss); a
  target the baseline reaches before its budget ends leaves the other recipes
  room to reach it too (the paper's runs stop at the MLPerf target). Overhead is
  against the same seed's baseline tokens; a seed without a baseline run uses
  the mean target and tokens. Tokens and overhead are medians over the seeds,
  a run that never reached the target counted as never (undefined when half
  or more did not reach it), not means over the runs that reached it.
  diverge_loss: a finished run ending above it is diverged; default halfway
  between the baseline's first and final validation loss (a run that gave
  back half of what training gained). A run with a non-finite loss, or that
  the trainer stopped for non-finite steps, is diverged too.
  """
  base = runs.get(baseline) or []
  if target is not None:
    targets = {None: float(target)}
  elif not base:
    raise errors.UserError(f"no runs of the baseline {baseline!r} to take the target from; "
                     "give the target loss explicitly")
  else:
    targets = {r.seed: float(np.interp(target_at * r.tokens_T[-1], r.tokens_T, r.loss_T))
               for r in base}
  mean_target = float(np.mean(list(targets.values())))
  if diverge_loss is None and base and base[0].loss_T.size:
    diverge_loss = float(np.mean([(r.loss_T[0] + r.final_loss) / 2 for r in base]))

  def outcome(run):
    if not run.loss_T.size:
      return ttt.Outcome(None, False)
    return ttt.tokens_to_target(run.tokens_T, run.loss_T, targets.get(run.seed, mean_target),
                                diverge_loss if run.finished else None)

  outcomes = {recipe: [outcome(r) for r in rs] for recipe, rs in runs.items()}
  base_final = {r.seed: r.final_loss for r in base}
  base_tokens = {r.seed: o.tokens for r, o in zip(base, outcomes.get(baseline, []))
                 if o.tokens is not None}
  mean_base_tokens = float(np.mean(list(base_tokens.values()))) if base_tokens else None
  rows = []
  for recipe, rs in runs.items():
    outs = outcomes[recipe]
    reached = [o.tokens for o in outs if o.tokens is not None]
    overheads = []  # per seed; None: never reached (a reached run without a baseline: left out)
    for r, o in zip(rs, outs):
      extra = None if o.tokens is None else ttt.overhead(
          o.tokens, base_tokens.get(r.seed, mean_base_tokens))
      if o.tokens is None or extra is not None:
        overheads.append(extra)
    walls = [r.wall_s for r in rs if r.wall_s is not None]
    deltas = [r.final_loss - base_final[r.seed] for r in rs if r.seed in base_final]
    rows.append(Row(
        recipe=recipe, n=len(rs),
        final_loss=_mean_spread([r.final_loss for r in rs]),
        delta_loss=_mean_spread(deltas) if deltas else None,
        tokens=ttt.median_with_misses(o.tokens for o in outs), reached=len(reached),
        overhead=ttt.median_with_misses(overheads),
        diverged=sum(o.diverged or r.status == "diverged" for o, r in zip(outs, rs)),
        skipped=sum(r.skipped_steps for r in rs),
        wall_s=float(np.mean(walls)) if walls else None,
        finished=sum(r.finished for r in rs)))
  return rows, targets, diverge_loss


def _fmt(ms, fmt, scale=1.0, unit=""):
  """'mean ± spread' (the spread only when nonzero), '-' for None, 'nan' for NaN."""
  if ms is None:
    return "-"
  mean, spread = ms
  if not math.isfinite(mean):
    return "nan"
  out = f"{mean * scale:{fmt}}{unit}"
  return out + (f" ± {abs(spread) * scale:{fmt.lstrip('+')}}{unit}" if spread else "")


def write_table(path, rows, targets, diverge_loss, note, diag=None, sections=(), banner=""):
  """Writes table.md: one line per recipe, the paper's overhead beside ours.

  targets: {seed: target loss}; note: how the target was chosen
  (target_note). diag: optional {recipe: {column: value}}, a second table.
  sections: further markdown lines, appended (paired estimates, SNR, verdicts);
  banner: text before everything else.
  """
  seeds = max((r.n for r in rows), default=1)
  values = ", ".join(f"{t:.4f}" + ("" if s is None else f" (seed {s})")
                     for s, t in sorted(targets.items(), key=lambda kv: str(kv[0])))
  lines = [
      f"{banner}Target: validation loss {values} ({note}); overhead = tokens to target / the "
      f"same seed's baseline tokens - 1; diverged = non-finite loss, stopped on "
      f"non-finite steps, or final loss > "
      f"{diverge_loss if diverge_loss is None else round(diverge_loss, 4)}."
      + (f" Final val loss and vs baseline: mean ± std over {seeds} seeds; tokens to target "
         "and overhead: the median over the seeds, a seed that never reached the target "
         "counted as never (undefined when half or more did not reach it)."
         if seeds > 1 else ""), "",
      "| recipe | final val loss | vs baseline (same seed) | tokens to target "
      "| overhead vs baseline | diverged? | skipped steps | wall time (s) "
      "| paper (8B, C4): extra tokens vs FP8 |",
      "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    tokens = "undefined" if r.tokens is None else f"{r.tokens:,.0f}"
    if r.reached < r.n:
      tokens = "not reached" if not r.reached else f"{tokens} ({r.reached}/{r.n} reached)"
    overhead = "-" if r.overhead is None else f"{100 * r.overhead:+.1f}%"
    diverged = ("yes" if r.diverged == r.n else f"{r.diverged}/{r.n}") if r.diverged else "no"
    unfinished = "" if r.finished == r.n else f" (running: {r.n - r.finished}/{r.n})"
    lines.append(
        f"| {r.recipe}{unfinished} | {_fmt(r.final_loss, '.4f')} | "
        f"{_fmt(r.delta_loss, '+.4f')} | {tokens} | "
        f"{overhead} | {diverged} | "
        f"{r.skipped} | {'-' if r.wall_s is None else f'{r.wall_s:.0f}'} | "
        f"{PAPER.get(r.recipe, '')} |")
  lines += diag_table("Wgrad error diagnostics (mean over measured steps and layers):", diag)
  lines += list(sections)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def diag_table(title, diag, fmt=".3f") -> list[str]:
  """Markdown lines: `title`, then one row per recipe of diag {recipe: {column: value}}."""
  if not diag:
    return []
  cols = list(next(iter(diag.values())))
  lines = ["", title, "", "| recipe | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for recipe, values in diag.items():
    lines.append(f"| {recipe} | " + " | ".join(
        "-" if values[c] is None else f"{values[c]:{fmt}}" for c in cols) + " |")
  return lines


DIAG_COLUMNS = {
    "wgrad out err (ref)": ("ref", "wgrad", "out_err"),
    "wgrad bias (train)": ("train", "wgrad", "bias"),
    "wgrad bias (ref)": ("ref", "wgrad", "bias"),
    "wgrad step cos (train)": ("train", "wgrad", "step_cos"),
    "wgrad step cos (ref)": ("ref", "wgrad", "step_cos"),
    "fprop out err (ref)": ("ref", "fprop", "out_err"),
    "dgrad out err (ref)": ("ref", "dgrad", "out_err"),
}


INSTRUMENT_COLUMNS = {
    "wgrad snr": ("train", "wgrad", "snr"),
    "wgrad snr_true": ("train", "wgrad", "snr_true"),
    "wgrad kappa": ("train", "wgrad", "kappa"),
    "wgrad signed X": ("train", "wgrad", "lhs_signed"),
    "wgrad signed dY": ("train", "wgrad", "rhs_signed"),
    "wgrad signed out": ("train", "wgrad", "out_signed"),
    "fprop signed X": ("train", "fprop", "lhs_signed"),
    "fprop signed W": ("train", "fprop", "rhs_signed"),
    "fprop signed out": ("train", "fprop", "out_signed"),
    "dgrad signed dY": ("train", "dgrad", "lhs_signed"),
    "dgrad signed out": ("train", "dgrad", "out_signed"),
}


def diag_summary(runs, columns=None):
  """{recipe: {column: mean over its runs, layers and steps}} for columns
  {name: (source, role, stat)} (default DIAG_COLUMNS); recipes without any left out."""
  columns = columns or DIAG_COLUMNS
  out = {}
  for recipe, rs in runs.items():
    values = {c: [] for c in columns}
    for run in rs:
      for key, (_, v) in figures.diag_series(run.rows).items():
        source, _, role, stat = figures.parse_key(key)
        for col, want in columns.items():
          if (source, role, stat) == want:
            values[col].extend(v[np.isfinite(v)])
    if any(values.values()):
      out[recipe] = {c: float(np.mean(v)) if v else None for c, v in values.items()}
  return out


def _final_eval(run):
  """The last evaluation row of a run (None before its first)."""
  evals = [r for r in run.rows if r.get("eval_loss") is not None]
  return evals[-1] if evals else None


def _paired_eval_se(run, base):
  """Standard error of the final eval-loss difference from the shared validation batches."""
  a, b = _final_eval(run), _final_eval(base)
  if not a or not b or "eval_batch_losses" not in a or "eval_batch_losses" not in b:
    return None
  diff = np.subtract(a["eval_batch_losses"], b["eval_batch_losses"])
  return float(diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else None


def _interval_text(i, fmt=".3f"):
  if not math.isfinite(i.mean):
    return "-"
  return f"{i.mean:{fmt}}" if i.n < 2 else f"{i.mean:{fmt}} [{i.lo:{fmt}}, {i.hi:{fmt}}]"


def _agree(a, b) -> str:
  """"yes" when two multiplier intervals say the same about 1 and hold each other's mean."""
  if a.n < 2 or b.n < 2 or not (math.isfinite(a.mean) and math.isfinite(b.mean)):
    return "-"
  side = lambda i: (i.lo > 1) - (i.hi < 1)
  same = side(a) == side(b) and a.contains(b.mean) and b.contains(a.mean)
  return "yes" if same else "NO"


def diverged_runs(runs) -> dict:
  """{(recipe, seed): what happened} of the runs that diverged: a non-finite
  validation loss, or stopped by the trainer on non-finite steps."""
  out = {}
  for recipe, rs in runs.items():
    for run in rs:
      bad = next((row for row in run.rows if row.get("eval_loss") is not None
                  and not math.isfinite(row["eval_loss"])), None)
      if bad is not None:
        out[(recipe, run.seed)] = f"validation loss {bad['eval_loss']} at step {bad['step']}"
      elif run.status == "diverged":
        out[(recipe, run.seed)] = "stopped by the trainer on non-finite steps"
  return out


def diverged_note(decl, diverged) -> str:
  """The sentence of a verdicts' paragraph: the declaration's rule for
  diverged runs ({(recipe, seed): what happened}) and those runs."""
  default = " (the default)" if decl.diverged == declaration_lib.DIVERGED_DEFAULT else ""
  runs = ", ".join(f"{r} seed {s} ({why})" for (r, s), why in sorted(
      diverged.items(), key=str)) or "none"
  return (f"Diverged runs (a non-finite validation loss, or stopped by the trainer on "
          f"non-finite steps) count by the declaration's rule `diverged: {decl.diverged}`"
          f"{default}: {declaration_lib.DIVERGED[decl.diverged]}. Diverged: {runs}.")


def estimates_section(runs, baseline="fp8", late_from=0.5):
  """Markdown: per recipe, paired loss differences and token multipliers vs the
  baseline; pairs with a diverged run are left out (and counted)."""
  base = {r.seed: r for r in runs.get(baseline, [])}
  diverged = diverged_runs(runs)
  ses = [_final_eval(r).get("eval_loss_se") for rs in runs.values() for r in rs if _final_eval(r)]
  ses = [x for x in ses if x is not None]
  lines = ["", f"Paired estimates against `{baseline}` (same seed: same data order and "
           "initialisation); mean [95% Student t-interval over seeds, not adjusted for "
           f"multiplicity]. Δ late mean: the mean over the evaluations in the last "
           f"{1 - late_from:.0%} of training of the paired difference. Token multiplier: "
           f"recipe tokens / `{baseline}` tokens for the same validation loss, over the "
           f"recipe's evaluations in the last {1 - late_from:.0%} of training (geometric mean "
           f"per seed), against `{baseline}`'s monotone-smoothed curve or against "
           "L = E + A t^-alpha fitted to it per seed (power law); 'agree' says whether the "
           "two intervals hold each other's mean and say the same about 1; 'extrapolated' "
           "counts evaluations below the baseline's last loss (monotone: read off its "
           "log-linear trend). Eval SE: standard error of the final evaluation over its "
           "batches"
           + (f" (absolute, mean over runs: {np.mean(ses):.4f} nats)" if ses else "")
           + "; paired: of the difference to the same seed's baseline on the same windows.",
           "", "| recipe | pairs | Δ late mean (nats) | Δ final val loss (nats) "
           "| token multiplier (monotone) | token multiplier (power law) | agree "
           "| extrapolated evals (monotone / power law) | paired eval SE |",
           "|---|---|---|---|---|---|---|---|---|"]
  for recipe, rs in runs.items():
    if recipe == baseline:
      continue
    pairs = [(r, base[r.seed]) for r in rs if r.seed in base and r.loss_T.size
             and base[r.seed].loss_T.size]
    ran = len(pairs)
    pairs = [(r, b) for r, b in pairs
             if (r.recipe, r.seed) not in diverged and (b.recipe, b.seed) not in diverged]
    shown = f"{ran}" if ran == len(pairs) else (
        f"{len(pairs)} (+{ran - len(pairs)} with a diverged run)")
    late = stats.t_interval([stats.late_mean(r.tokens_T, r.loss_T, late_from)
                             - stats.late_mean(b.tokens_T, b.loss_T, late_from) for r, b in pairs])
    deltas = stats.t_interval([r.final_loss - b.final_loss for r, b in pairs])
    mults = {curve: [stats.token_multiplier(r.tokens_T, r.loss_T, b.tokens_T, b.loss_T,
                                            late_from, curve) for r, b in pairs]
             for curve in (stats.BaselineCurve, stats.PowerLawCurve)}
    mono, power = (stats.multiplier_interval(m) for m in mults.values())
    extra = " / ".join(f"{sum(m.extrapolated for m in ms)}/{sum(m.points for m in ms)}"
                       for ms in mults.values())
    paired = [x for x in (_paired_eval_se(r, b) for r, b in pairs) if x is not None]
    lines.append(f"| {recipe} | {shown} | {late} | {deltas} | {_interval_text(mono)} | "
                 f"{_interval_text(power)} | {_agree(mono, power)} | {extra} | "
                 + (f"{np.mean(paired):.4f}" if paired else "-") + " |")
  return lines


def snr_series(runs, stats_=SNR_STATS):
  """{recipe: {(layer, role, stat): (steps, values)}}: training-batch SNRs, median over seeds
  (a single snr_true is often clipped to 0, which would make a geometric mean 0)."""
  out = {}
  for recipe, rs in runs.items():
    per = {}
    for run in rs:
      for key, (steps, values) in figures.diag_series(run.rows).items():
        source, layer, role, stat = figures.parse_key(key)
        if source == "train" and stat in stats_ and role == "wgrad":
          per.setdefault((layer, role, stat), []).append(dict(zip(steps.tolist(), values.tolist())))
    series = {}
    for name, dicts in per.items():
      common = sorted(set.intersection(*(set(d) for d in dicts)))
      if common:
        series[name] = (np.array(common, np.float64),
                        np.median([[d[s] for d in dicts] for s in common], axis=1))
    if series:
      out[recipe] = series
  return out


def instruments_section(runs):
  """Markdown: per recipe, the batch SNR, snr_true, kappa and signed errors (training batch)."""
  summary = diag_summary(runs, INSTRUMENT_COLUMNS)
  summary = {r: v for r, v in summary.items() if v["wgrad snr_true"] is not None}
  if not summary:
    return ["", "Instruments: these runs logged no snr_true (diagnostics older than it)."]
  return diag_table(
      "Instruments on the training batch (fp4jax.diagnostics; mean over measured steps, layers "
      "and runs): wgrad snr = ||exact dW|| / ||its quantization error||; snr_true = "
      "sqrt(max(<dW_a, dW_b>, 0)) / the same error, dW_a and dW_b the exact gradients of the "
      "two halves of the batch; kappa = snr x sqrt(eps_X^2 + eps_dY^2) (1: the batch SNR is "
      "the format's constant); signed = <q(a) - a, a> / ||a||^2 of each operand and of the "
      "GEMM output (negative: shrinkage toward zero).", summary, "+.4f")


def _environment_text(env):
  packages = ", ".join(f"{name} {version}" for name, version in env["packages"].items())
  flags = f", XLA_FLAGS {env['xla_flags']!r}" if env["xla_flags"] else ""
  return f"Python {env['python']}, {packages}; CPU {env['cpu']}{flags}"


def environments_section(runs):
  """Markdown: the environments that made the runs (wall.json), the runs of
  each, and the seeds whose arms were made in more than one."""
  labels, made_in, seeds = {}, {}, {}
  for rs in runs.values():
    for run in rs:
      for env in run.environments or [None]:
        key = json.dumps(env, sort_keys=True)
        labels.setdefault(key, env)
        made_in.setdefault(key, []).append(f"{run.recipe} seed {run.seed}")
        seeds.setdefault(run.seed, set()).add(key)
  lines = ["", f"Made in {len(labels)} environment(s) (a run's bits depend on the CPU and "
           "the jax, jaxlib, numpy and ml_dtypes releases, not only on the code; arms compared "
           "within a seed are treated alike where its runs share one):"]
  for i, (key, env) in enumerate(labels.items()):
    what = _environment_text(env) if env else "not recorded (runs before fp4jax recorded it)"
    lines.append(f"- E{i + 1}: {what}: {', '.join(made_in[key])}")
  spanning = [f"{r.recipe} seed {r.seed}" for rs in runs.values() for r in rs
              if r.environments and len(r.environments) > 1]
  if spanning:
    lines.append(f"- Resumed in another environment (one run, two or more): {', '.join(spanning)}")
  mixed = sorted(s for s, keys in seeds.items() if len(keys) > 1 and s is not None)
  if mixed:
    lines.append(f"- Seeds whose arms were made in more than one: {', '.join(map(str, mixed))}")
  return lines


def smallest_effect(runs, decl):
  """(the baseline's late slope dL/d ln(tokens), mean over its seeds; the
  declaration's smallest effect of interest in nats through it)."""
  slopes = [s for s in (hypothesis_tests.log_slope(r.tokens_T, r.loss_T, decl.late_from)
                        for r in runs.get(decl.baseline) or []) if math.isfinite(s)]
  slope = float(np.mean(slopes)) if slopes else math.nan
  return slope, hypothesis_tests.effect_nats(slope, decl.smallest_effect_tokens)


def judge(runs, decl) -> tuple:
  """The declaration's claims on `runs`: (the baseline's late slope, the
  smallest effect in nats, [verdicts.ClaimResult], the diverged runs
  {(recipe, seed): what happened})."""
  slope, smallest = smallest_effect(runs, decl)
  evaluated = {rc: [r for r in rs if r.loss_T.size] for rc, rs in runs.items()}
  if decl.primary == "late_mean":
    primary = {rc: {r.seed: stats.late_mean(r.tokens_T, r.loss_T, decl.late_from) for r in rs}
               for rc, rs in evaluated.items() if rs}
  else:
    primary = {rc: {r.seed: r.final_loss for r in rs} for rc, rs in evaluated.items() if rs}
  diverged = diverged_runs(runs)
  return slope, smallest, verdicts.evaluate(decl, primary, smallest, set(diverged)), diverged


def verdict_section(runs, decl, workdir):
  """Markdown: the declaration's status, its smallest effect in nats, one line per claim."""
  if decl is None:
    return ["", "Verdicts: none (no declaration; see fp4jax.experiments.declaration)."]
  state = declaration_lib.status(workdir, decl.path)
  head = {
      "declared": "Declared before the first run (its SHA-256 was recorded when the runs "
                  "began and matches).",
      "changed": "**EXPLORATORY: the declaration changed after the first run began** (its "
                 "SHA-256 differs from the one recorded then).",
      "undeclared": "**EXPLORATORY: these rules were fixed after the data were seen** (no "
                    "declaration was recorded when the first run began)."}[state]
  base = runs.get(decl.baseline) or []
  slope, smallest, results, diverged = judge(runs, decl)
  what = (f"the per-seed mean over the evaluations in the last {1 - decl.late_from:.0%} of "
          "training of the contrast of validation losses" if decl.primary == "late_mean" else
          "the per-seed contrast of final validation losses")
  return ["", f"Verdicts by the declaration `{os.path.basename(decl.path)}` of study "
          f"`{decl.study}`. {head} Primary statistic: {what}. Smallest effect of interest: "
          f"{decl.smallest_effect_tokens:.0%} more tokens = {smallest:.4f} nats through "
          f"`{decl.baseline}`'s late slope dL/d ln(tokens) = {slope:.4f} (mean over its "
          f"{len(base)} seeds). {decl.correction.capitalize()} over the {len(decl.claims)} "
          f"claims at family level {decl.alpha}: a claim's p is its largest contrast p; each "
          "interval is the t-interval at the level Holm gives its claim. '> 0' is supported "
          "when that interval lies above 0 and contradicted when it lies below the smallest "
          "effect; '!= 0' supported when it excludes 0, contradicted inside ± the smallest "
          "effect. Sign-flip p: exact over all sign patterns of the seeds (unadjusted). MDE: "
          f"the true effect found with {decl.power:.0%} power at the claim's level, taking the "
          "observed spread as the true one. " + diverged_note(decl, diverged), ""
          ] + verdicts.lines(results, smallest, decl.power)


def write_report(workdir, recipes=None, baseline="fp8", target=None, diverge_loss=None,
                 zoom=0.5, window=None, target_at=1.0, late_from=0.5, declaration=None):
  """Writes table.md, curves.png, diagnostics.png, snr.png and <run>/diagnostics.png; returns rows.

  declaration: the study's declaration file (default WORKDIR/DECLARATION.json;
  without one the table has no verdicts).
  """
  runs = load_runs(workdir, recipes)
  if not runs and os.path.isfile(run_layout.metrics_file(workdir)):
    parent = os.path.dirname(os.path.abspath(workdir))
    raise errors.UserError(
        f"{workdir!r} is the folder of one run (it holds metrics.jsonl); give "
        f"the folder that holds the runs, e.g. {parent!r}")
  if not runs:
    raise errors.UserError(f"no runs with metrics.jsonl under {workdir!r}"
                           + _umbrella_hint(workdir))
  default = os.path.join(workdir, "DECLARATION.json")
  decl = declaration_lib.load(declaration or default) if (
      declaration or os.path.exists(default)) else None
  note = target_note(baseline, target is not None, target_at)
  rows, targets, diverge_loss = summarize(runs, baseline, target, diverge_loss, target_at)
  diag = diag_summary(runs)
  series = snr_series(runs)
  sections = (estimates_section(runs, baseline, late_from) if baseline in runs else [])
  sections += (instruments_section(runs) + verdict_section(runs, decl, workdir)
               + environments_section(runs))
  banner = ("**EXPLORATORY: the verdicts of this table do not follow rules declared before "
            "its first run** (see the verdicts' paragraph).\n\n") if (
      decl is not None and declaration_lib.status(workdir, decl.path) != "declared") else ""
  check_report_files(workdir, [run.path for rs in runs.values() for run in rs])
  write_table(os.path.join(workdir, TABLE), rows, targets, diverge_loss, note, diag,
              sections, banner)
  figures.plot_snr(os.path.join(workdir, SNR), series, diagnostics.SNR_THRESHOLD)
  figures.plot_curves(os.path.join(workdir, CURVES), runs, zoom,
                    float(np.mean(list(targets.values()))), baseline)
  figures.plot_diagnostics_summary(os.path.join(workdir, DIAGNOSTICS), diag, window)
  for rs in runs.values():
    for run in rs:
      figures.plot_diagnostics(os.path.join(run.path, DIAGNOSTICS), run)
  return rows


# The command that reads a folder of studies, by its DECLARATION.json's key.
UMBRELLAS = {"horizon_contrast": "python -m fp4jax.experiments.stage_cumulative",
             "trend": "python -m fp4jax.experiments.trend"}


def _umbrella_hint(workdir) -> str:
  """Where `workdir` declares studies in its subfolders: the command that reads them."""
  try:
    with open(os.path.join(workdir, "DECLARATION.json"), encoding="utf-8") as f:
      keys = json.load(f)
  except (OSError, ValueError):
    return ""
  hits = [f"{cmd} {workdir}" for key, cmd in UMBRELLAS.items() if isinstance(keys, dict)
          and key in keys]
  return (f" (its DECLARATION.json declares studies in its subfolders: read them with "
          f"{hits[0]}, or give one subfolder)") if hits else ""


def check_report_files(workdir, run_paths):
  """UserError (one line) before anything is drawn when a file the report
  writes (REPORT_FILES in `workdir`, DIAGNOSTICS in each run's folder) is a
  symbolic link or a folder: the report would write through the link, over
  the file it points to."""
  paths = [os.path.join(workdir, n) for n in REPORT_FILES] + [
      os.path.join(p, DIAGNOSTICS) for p in run_paths]
  run_layout.check_files_written(paths, "the report")


_USAGE = ("usage: python -m fp4jax.experiments.report WORKDIR [--target=LOSS] "
          "[--target_at=FRACTION] [--baseline=NAME] [--declaration=PATH]")
_OPTIONS = {"target": float, "target_at": float, "baseline": str, "declaration": str}


def _options(args):
  """{name: value} of --name=value arguments; UserError naming a bad one."""
  opts = {}
  for arg in args:
    name, eq, value = arg.lstrip("-").partition("=")
    if not arg.startswith("--") or not eq or name not in _OPTIONS:
      raise errors.UserError(f"unknown argument {arg!r}"
                             f"{errors.did_you_mean(name, _OPTIONS, '--')}; "
                             + _USAGE)
    try:
      opts[name] = _OPTIONS[name](value)
    except ValueError:
      raise errors.UserError(f"--{name}={value!r} is not a number") from None
  return opts


def main(argv):
  """Redraws the report; defaults come from WORKDIR/ablation_config.json when present."""
  prog = "python -m fp4jax.experiments.report"
  if any(a in ("-h", "--help") for a in argv[1:]):
    print(_USAGE)
    return 0
  try:
    if len(argv) < 2:
      raise errors.UserError(_USAGE)
    _redraw(argv[1], _options(argv[2:]))
  except errors.UserError as e:
    return errors.report(prog, e)
  return 0


def _study_declaration(workdir, recorded):
  """The declaration a study folder's report reads: its own DECLARATION.json
  when it has one (a folder moved or copied keeps it), else the path its
  ablation_config.json records (None: none)."""
  own = os.path.join(workdir, "DECLARATION.json")
  if os.path.exists(own) or not recorded:
    return own if os.path.exists(own) else None
  if not os.path.exists(recorded):
    raise errors.UserError(
        f"{os.path.join(workdir, study_config.RECORD)} names the declaration {recorded!r} "
        f"(a path from where the study's first run started), not found from here, and "
        f"{workdir!r} holds no DECLARATION.json; give --declaration=PATH")
  return recorded


def _recorded_order(workdir, ab):
  """The recipes or arms in the order the study ran them (its table's row
  order): ablation_config.json's recipes, else (an arm study records none)
  the keys of its arms.json; None: sorted by name."""
  names = [r for r in ab.get("recipes", "").split(",") if r]
  path = os.path.join(workdir, "arms.json")
  if not names and os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      arms = json.load(f)
    names = list(arms) if isinstance(arms, dict) else []
  return names or None


def _redraw(workdir, opts):
  if not os.path.isdir(workdir):
    raise errors.UserError(f"{workdir!r} is not a directory; give the "
                           "--workdir of an ablation")
  where = os.path.join(workdir, study_config.RECORD)
  saved = records.read_if_present(records.StudyConfig, where) or {}
  ab = records.check(records.AblationBlock, saved.get("ablation", {}), f"{where}: ablation")
  diag = records.check(records.DiagnosticsBlock, saved.get("diagnostics") or {},
                       f"{where}: diagnostics")
  target = opts.get("target", ab.get("target_loss"))
  write_report(
      workdir, _recorded_order(workdir, ab),
      baseline=opts.get("baseline", ab.get("baseline", "fp8")),
      target=None if target is None else float(target),
      diverge_loss=ab.get("diverge_loss"), zoom=ab.get("zoom", 0.5),
      late_from=ab.get("late_from", 0.5),
      declaration=opts.get("declaration") or _study_declaration(workdir, ab.get("declaration")),
      window=diag.get("window") if diag.get("enabled") else None,
      target_at=float(opts.get("target_at", ab.get("target_at", 1.0))))
  with open(os.path.join(workdir, TABLE)) as f:
    print(f.read())


if __name__ == "__main__":
  sys.exit(main(sys.argv))
