"""A paired contrast against model size, over one study's widths, with a prediction at 8B.

  python -m fp4jax.experiments.trend results/stage_widths

FOLDER/DECLARATION.json declares the design (`design.non_embedding_parameters`
{width: N}; `design.parameters_at_8B.non_embedding`) and the trend
(`trend.claims`: {"contrast": "LABEL = A - B", "direction", "text", "paper"};
`trend.smallest_slope`; `trend.descriptive`: contrasts fitted without a
verdict). Each width's study is FOLDER/w<width>/, with its own
DECLARATION.json (baseline, late_from: fp4jax.experiments.declaration).

Per contrast, seed s and width w: y = (late mean of A - late mean of B) /
(-slope_w), slope_w the baseline's late slope dL/d ln(tokens) at that width
(mean over its seeds, the slope of the width's smallest effect): the ln of
the extra tokens the baseline would need to lose as much (first order).
A seed where A or B diverged (report.diverged_runs) is left out. x = ln(N_w).
Ordinary least squares of y on x over every (seed, width) point (df =
points - 2); the slope's t-interval at the level Holm over the claims gives
it, judged by hypothesis_tests.decide against the smallest slope; the line
at the 8B x with its 95% interval (for the line, not a new seed), as extra
tokens exp(y) - 1. Writes FOLDER/trend.md and FOLDER/trend.png.
"""

import dataclasses
import math
import os
import sys

import numpy as np
from absl import app
from scipy import stats as scipy_stats

from fp4jax import errors
from fp4jax import records
from fp4jax.experiments import declaration, hypothesis_tests, report, stats


@dataclasses.dataclass(frozen=True)
class TrendDeclaration:
  """a study's declaration of a trend over widths (design, trend)"""
  study: str
  design: dict
  trend: dict


@dataclasses.dataclass(frozen=True)
class Fit:
  """y = intercept + slope x by least squares over `n` points (x_mean, sxx: of x)."""
  slope: float
  intercept: float
  se_slope: float
  resid_var: float
  n: int
  x_mean: float
  sxx: float

  @property
  def df(self) -> int:
    return self.n - 2

  def line_at(self, x0) -> tuple:
    """(the line at x0, its standard error)."""
    se = math.sqrt(self.resid_var * (1 / self.n + (x0 - self.x_mean) ** 2 / self.sxx))
    return self.intercept + self.slope * x0, se

  def slope_p(self) -> float:
    """Two-sided t p-value of slope 0."""
    return float(2 * scipy_stats.t.sf(abs(self.slope / self.se_slope), self.df))

  def slope_interval(self, level) -> tuple:
    half = scipy_stats.t.ppf(0.5 + level / 2, self.df) * self.se_slope
    return self.slope - half, self.slope + half

  def slope_mde(self, alpha, power) -> float:
    """The true slope found with `power` by the two-sided test at `alpha`: the
    one-sample t-test's MDE with the same standard error and df (m = df + 1)."""
    m = self.df + 1
    return hypothesis_tests.mde(self.se_slope * math.sqrt(m), m, alpha, power)


def fit_line(x, y) -> Fit:
  """Fit of y on x (at least 3 points and two distinct x)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  n, x_mean = x.size, float(x.mean())
  sxx = float(((x - x_mean) ** 2).sum())
  if n < 3 or sxx == 0:
    raise ValueError(f"a line needs >= 3 points at >= 2 distinct x, got {n}")
  slope = float(((x - x_mean) * (y - y.mean())).sum() / sxx)
  intercept = float(y.mean() - slope * x_mean)
  resid_var = float(((y - intercept - slope * x) ** 2).sum() / (n - 2))
  return Fit(slope, intercept, math.sqrt(resid_var / sxx), resid_var, n, x_mean, sxx)


def parse_contrast(text) -> tuple:
  """("LABEL", "A", "B") of "LABEL = A - B" (spaces around '=' and '-': arm names may hold '-')."""
  label, eq, rest = text.partition(" = ")
  plus, minus_sign, minus = rest.partition(" - ")
  if not (eq and minus_sign and label.strip() and plus.strip() and minus.strip()):
    raise errors.UserError(f"trend contrast {text!r} is not 'LABEL = A - B'")
  return label.strip(), plus.strip(), minus.strip()


def points(runs, plus, minus, baseline, late_from) -> dict:
  """{seed: y} at one width (module docstring); seeds where either run diverged are left out."""
  slope = report.smallest_effect(runs, _Smallest(baseline, late_from))[0]
  bad = set(report.diverged_runs(runs))
  late = {arm: {r.seed: stats.late_mean(r.tokens_T, r.loss_T, late_from)
                for r in runs.get(arm, []) if r.finished and (arm, r.seed) not in bad}
          for arm in (plus, minus)}
  seeds = sorted(set(late[plus]) & set(late[minus]))
  return {s: (late[plus][s] - late[minus][s]) / -slope for s in seeds}


@dataclasses.dataclass(frozen=True)
class _Smallest:
  """What report.smallest_effect reads of a declaration (its smallest effect is not used here)."""
  baseline: str
  late_from: float
  smallest_effect_tokens: float = 0.05


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One contrast's trend: its fit, its points {width: {seed: y}} and its verdict (or None)."""
  label: str
  fit: Fit | None
  by_width: dict
  verdict: str | None = None
  interval: tuple = (math.nan, math.nan)
  level: float = math.nan
  mde: float = math.nan


def _fit_of(by_width, params):
  xs = [math.log(params[w]) for w, ys in by_width.items() for _ in ys]
  ys = [y for w in by_width for y in by_width[w].values()]
  try:
    return fit_line(xs, ys)
  except ValueError:
    return None


def analyse(folder) -> tuple:
  """(the umbrella declaration as read, [Outcome] of the claims then the descriptive contrasts)."""
  decl = records.read(TrendDeclaration, os.path.join(folder, "DECLARATION.json"))
  params = {int(w): n for w, n in decl["design"]["non_embedding_parameters"].items()}
  widths = {}
  for w in params:
    sub = os.path.join(folder, f"w{w}")
    widths[w] = (report.load_runs(sub) if os.path.isdir(sub) else {},
                 declaration.load(os.path.join(sub, "DECLARATION.json")))
  trend = decl["trend"]
  entries = [(c, True) for c in trend["claims"]] + [(c, False) for c in trend.get("descriptive", [])]
  outcomes = []
  for entry, judged in entries:
    label, plus, minus = parse_contrast(entry["contrast"])
    by_width = {w: points(runs, plus, minus, d.baseline, d.late_from)
                for w, (runs, d) in widths.items()}
    outcomes.append((Outcome(label, _fit_of(by_width, params), by_width), entry, judged))
  judged = [o for o, _, j in outcomes if j]
  p = [o.fit.slope_p() if o.fit else math.nan for o in judged]
  levels = hypothesis_tests.holm_levels(p, trend.get("alpha", 0.05))
  smallest = trend["smallest_slope"]
  done = []
  for o, entry, is_claim in outcomes:
    if is_claim and o.fit:
      level = levels[judged.index(o)]
      lo, hi = o.fit.slope_interval(level)
      o = dataclasses.replace(o, interval=(lo, hi), level=level,
                              verdict=hypothesis_tests.decide(lo, hi, entry["direction"], smallest),
                              mde=o.fit.slope_mde(1 - level, 0.8))
    elif is_claim:
      o = dataclasses.replace(o, verdict="not judged (fewer than 3 points)")
    done.append((o, entry))
  return decl, params, done


def _pct(y) -> str:
  return f"{math.expm1(y):+.1%}"


def table(decl, params, done) -> list[str]:
  """trend.md's lines."""
  x8 = math.log(decl["design"]["parameters_at_8B"]["non_embedding"])
  widths = sorted(params)
  head = " | ".join(f"w{w} ({params[w]:,}): mean extra tokens, n" for w in widths)
  lines = [f"# Trend of `{decl['study']}` against ln(non-embedding parameters)", "",
           "y per seed = paired late-mean contrast / (-baseline late slope at that width), shown as "
           "extra tokens exp(y) - 1. Slope: nats of ln(tokens) per e-fold of parameters, "
           f"t-interval at its Holm level; smallest slope of interest {decl['trend']['smallest_slope']}. "
           "At 8B: the fitted line and its 95% interval (an extrapolation beyond the widths).", "",
           f"| contrast | {head} | slope [interval] | verdict | MDE | at 8B [95%] | paper (8B, C4) |",
           "|---|" + "---|" * len(widths) + "---|---|---|---|---|"]
  for o, entry in done:
    cells = []
    for w in widths:
      ys = list(o.by_width[w].values())
      cells.append(f"{_pct(float(np.mean(ys)))}, n={len(ys)}" if ys else "-")
    if o.fit:
      y8, se8 = o.fit.line_at(x8)
      half = scipy_stats.t.ppf(0.975, o.fit.df) * se8
      at8 = f"{_pct(y8)} [{_pct(y8 - half)}, {_pct(y8 + half)}]"
      slope = (f"{o.fit.slope:+.4f} [{o.interval[0]:+.4f}, {o.interval[1]:+.4f}] ({o.level:.2%})"
               if o.verdict else f"{o.fit.slope:+.4f} (no verdict)")
    else:
      at8, slope = "-", "-"
    mde = f"{o.mde:.4f}" if math.isfinite(o.mde) else "-"
    lines.append(f"| {entry['contrast']} | " + " | ".join(cells) +
                 f" | {slope} | {o.verdict or 'descriptive'} | {mde} | {at8} | {entry.get('paper', '')} |")
  return lines


def plot(path, decl, params, done):
  """trend.png: one panel per contrast: per-seed points, per-width means, the line to 8B."""
  from fp4jax.experiments import figures  # pylint: disable=import-outside-toplevel
  plt = figures.plt
  n8 = decl["design"]["parameters_at_8B"]["non_embedding"]
  fig, axes = plt.subplots(1, len(done), figsize=(4.2 * len(done), 3.6), squeeze=False)
  for ax, (o, entry) in zip(axes[0], done):
    for w, ys in o.by_width.items():
      ax.scatter([params[w]] * len(ys), [math.expm1(y) for y in ys.values()], s=10, alpha=0.5)
      if len(ys) > 1:
        i = stats.t_interval(list(ys.values()))
        ax.errorbar([params[w]], [math.expm1(i.mean)], color="k", capsize=3, fmt="o",
                    yerr=[[math.expm1(i.mean) - math.expm1(i.lo)], [math.expm1(i.hi) - math.expm1(i.mean)]])
    if o.fit:
      n_T = np.geomspace(min(params.values()), n8, 50)
      line = [o.fit.line_at(math.log(n)) for n in n_T]
      half = scipy_stats.t.ppf(0.975, o.fit.df)
      ax.plot(n_T, [math.expm1(y) for y, _ in line], "k-", lw=1)
      ax.fill_between(n_T, [math.expm1(y - half * s) for y, s in line],
                      [math.expm1(y + half * s) for y, s in line], color="k", alpha=0.1)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xscale("log")
    ax.set_title(entry["contrast"], fontsize=9)
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("extra tokens")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write(folder) -> str:
  """Writes FOLDER/trend.md and trend.png; returns the table's text."""
  decl, params, done = analyse(folder)
  text = "\n".join(table(decl, params, done)) + "\n"
  with open(os.path.join(folder, "trend.md"), "w") as f:
    f.write(text)
  plot(os.path.join(folder, "trend.png"), decl, params, done)
  return text


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m fp4jax.experiments.trend FOLDER")
  try:
    print(write(argv[1]), end="")
  except errors.UserError as e:
    print(f"python -m fp4jax.experiments.trend: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  app.run(main)
