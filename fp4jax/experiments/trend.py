"""A paired contrast against model size, over one study's widths, with a prediction at 8B.

  python -m fp4jax.experiments.trend results/stage_widths

FOLDER/DECLARATION.json declares the design (`design.non_embedding_parameters`
{width: N}; `design.parameters_at_8B.non_embedding`) and the trend
(`trend.claims`: {"contrast": "LABEL = A - B", "direction", "text", "paper"};
`trend.smallest_slope`; `trend.descriptive`: contrasts fitted without a
verdict; `trend.min_widths`, optional: how many of the declared widths a
verdict needs points at, default all of them). Each width's study is
FOLDER/w<width>/, with its own DECLARATION.json (baseline, late_from,
diverged: fp4jax.experiments.declaration).

Per contrast, seed s and width w: y = (late mean of A - late mean of B) /
(-slope_w), slope_w the baseline's late slope dL/d ln(tokens) at that width
(mean over its seeds, the slope of the width's smallest effect): the ln of
the extra tokens the baseline would need to lose as much (first order).
That needs a falling baseline: a width whose slope is not negative, or
whose per-seed slopes' 95% t-interval does not lie below 0, gives no points
(named with its slope). A declared width without runs gives none either.
A seed is left out where a run of A or B diverged (report.diverged_runs),
is not finished or has no partner; every run left out is named. A diverged
run counts by its width's declaration (`diverged`): "exclude" leaves its
seed out; "inconclusive" judges no claim with one among its seeds. x =
ln(N_w). Ordinary least squares of y on x over every (seed, width) point
(df = points - 2); the slope's t-interval at the level Holm over the claims
gives it, judged by hypothesis_tests.decide against the smallest slope; a
claim is not judged (p = 1 in Holm, the reason in its verdict) with points
at fewer widths than the declaration needs, with no line (fewer than 3
points or 2 widths), or by the rule for diverged runs. The line at the 8B x
with its 95% interval (for the line, not a new seed), as extra tokens
exp(y) - 1.

Writes FOLDER/trend.md and FOLDER/trend.png. The first time, it records
FOLDER/DECLARATION.json's SHA-256 in FOLDER/declaration_record.json
(declaration.record; never overwritten); trend.md is marked EXPLORATORY
when that declaration, or a width's, no longer matches its record (or a
width's was never recorded). A folder it cannot write is one line, exit 2.
"""

import dataclasses
import math
import os

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


@dataclasses.dataclass(frozen=True)
class Width:
  """One declared width: its non-embedding parameters, FOLDER/w<width>'s runs,
  declaration (None: no runs and no declaration) and its status
  (declaration.status; "" without one), the runs that diverged
  (report.diverged_runs), the baseline's late slope (the mean over its seeds,
  as report.smallest_effect; `slopes` their t-interval) and why the width
  gives no points ("" when it does)."""
  width: int
  params: int
  runs: dict
  decl: declaration.Declaration | None
  state: str
  diverged: dict
  slope: float
  slopes: stats.Interval
  withheld: str


def falling(slope, slopes) -> bool:
  """True when the baseline's late slope (mean `slope`, per-seed t-interval
  `slopes`) is negative, and with 2 seeds or more its interval lies below 0."""
  return math.isfinite(slope) and slope < 0 and (slopes.n < 2 or slopes.hi < 0)


def load_width(folder, width, params) -> Width:
  """The Width of FOLDER/w<width> (module docstring)."""
  return load_study(os.path.join(folder, f"w{width}"), width, params)


def load_study(sub, width=0, params=0, path=None) -> Width:
  """The study folder `sub` (its runs, and the declaration `path`, default
  its own DECLARATION.json) as a Width (width, params: its model's, where
  the study is one of a trend's)."""
  runs = report.load_runs(sub) if os.path.isdir(sub) else {}
  path = path or os.path.join(sub, "DECLARATION.json")
  decl = declaration.load(path) if runs or os.path.exists(path) else None
  state = declaration.status(sub, path) if decl else ""
  if not runs:
    where = f"in {sub}" if os.path.isdir(sub) else f"({sub} does not exist)"
    return Width(width, params, {}, decl, state, {}, math.nan,
                 stats.Interval(math.nan, math.nan, math.nan, 0), f"no runs {where}")
  slope = report.smallest_effect(runs, decl)[0]
  slopes = stats.t_interval([hypothesis_tests.log_slope(r.tokens_T, r.loss_T, decl.late_from)
                             for r in runs.get(decl.baseline) or []])
  withheld = ""
  if slopes.n == 0:
    withheld = (f"no late slope of the baseline {decl.baseline} (no run of it with 2 late "
                "evaluations): its loss gaps have no token equivalent, so it gives no points")
  elif not falling(slope, slopes):
    spread = (f" [{slopes.lo:+.4f}, {slopes.hi:+.4f}] (95% over its {slopes.n} seeds)"
              if slopes.n > 1 else " (1 seed)")
    withheld = (f"the baseline {decl.baseline}'s late slope dL/d ln(tokens) is {slope:+.4f}"
                f"{spread}: not falling, and extra tokens need a falling baseline (a loss gap "
                "has no token equivalent on a flat or rising curve), so it gives no points")
  return Width(width, params, runs, decl, state, report.diverged_runs(runs), slope, slopes,
               withheld)


def points(width, plus, minus) -> tuple:
  """At one Width, for the contrast plus - minus: ({seed: y} (module docstring),
  [(arm, seed, why)] of the runs left out, why the width gives no points (""
  when it does), [(arm, seed)] of the diverged runs among the seeds where
  both arms ran)."""
  if width.withheld:
    return {}, [], width.withheld, []
  absent = [a for a in (plus, minus) if not width.runs.get(a)]
  if absent:
    return {}, [], f"no runs of {' or '.join(absent)}", []
  ran = {a: {r.seed for r in width.runs[a]} for a in (plus, minus)}
  both = ran[plus] & ran[minus]
  late, left_out = {plus: {}, minus: {}}, []
  for arm, other in ((plus, minus), (minus, plus)):
    for r in width.runs[arm]:
      if (arm, r.seed) in width.diverged:
        why = f"diverged ({width.diverged[(arm, r.seed)]})"
      elif r.seed not in both:
        why = f"has no {other} run of its seed to pair with"
      elif not r.finished:
        why = f"not finished (status {r.status or 'none yet'})"
      else:
        value = stats.late_mean(r.tokens_T, r.loss_T, width.decl.late_from)
        if math.isfinite(value):
          late[arm][r.seed] = value
          continue
        why = "has no late evaluations"
      left_out.append((arm, r.seed, why))
  seeds = sorted(set(late[plus]) & set(late[minus]))
  ys = {s: (late[plus][s] - late[minus][s]) / -width.slope for s in seeds}
  diverged = sorted((a, s) for a, s in width.diverged if a in (plus, minus) and s in both)
  return ys, left_out, "" if ys else "no seed where both arms finished", diverged


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One contrast's trend: its fit, its points {width: {seed: y}} and its
  verdict (or None: descriptive); the runs left out [(width, arm, seed, why)]
  and the widths without points {width: why}."""
  label: str
  fit: Fit | None
  by_width: dict
  verdict: str | None = None
  interval: tuple = (math.nan, math.nan)
  level: float = math.nan
  mde: float = math.nan
  left_out: tuple = ()
  missing: dict = dataclasses.field(default_factory=dict)


def _fit_of(by_width, params):
  xs = [math.log(params[w]) for w, ys in by_width.items() for _ in ys]
  ys = [y for w in by_width for y in by_width[w].values()]
  try:
    return fit_line(xs, ys)
  except ValueError:
    return None


def _plural(n, word):
  return f"{n} {word}{'' if n == 1 else 's'}"


def _widths(ws):
  return ", ".join(f"w{w}" for w in ws)


def read_declaration(path) -> dict:
  """The umbrella declaration FOLDER/DECLARATION.json as read (the keys of TrendDeclaration)."""
  return records.read(TrendDeclaration, path)


def min_widths(decl, path) -> int:
  """How many declared widths a verdict needs points at: trend.min_widths, default all."""
  n = len(decl["design"]["non_embedding_parameters"])
  k = decl["trend"].get("min_widths", n)
  if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= n:
    raise errors.UserError(f"{path}: trend.min_widths must be an integer from 2 to the {n} "
                           f"declared widths, got {k!r}")
  return k


def not_judged(by_width, fit, need, diverged) -> list[str]:
  """Why a claim gets no verdict ([]: judged): widths without points beyond
  what the declaration allows, no line, a diverged run where its width
  declares `diverged: inconclusive` ({width: [(arm, seed)]})."""
  reasons = []
  empty = [w for w, ys in by_width.items() if not ys]
  if empty and len(by_width) - len(empty) < need:
    allowed = (f"all {len(by_width)}" if need == len(by_width)
               else f"{need} of its {len(by_width)} (trend.min_widths)")
    reasons.append(f"no points at {_widths(empty)}: the declared design needs {allowed} widths")
  if fit is None:
    n = sum(len(ys) for ys in by_width.values())
    reasons.append(f"{_plural(n, 'point')} at {_plural(len(by_width) - len(empty), 'width')}: "
                   "a line needs 3 points at 2 widths")
  for w, bad in diverged.items():
    runs = ", ".join(f"{a} seed {s}" for a, s in bad)
    reasons.append(f"a run diverged at w{w} ({runs}), whose declaration says "
                   "`diverged: inconclusive`")
  return reasons


def analyse(folder) -> tuple:
  """(the umbrella declaration as read, {width: Width}, [(Outcome, its entry)]
  of the claims then the descriptive contrasts)."""
  path = os.path.join(folder, "DECLARATION.json")
  decl = read_declaration(path)
  need = min_widths(decl, path)
  params = {int(w): n for w, n in decl["design"]["non_embedding_parameters"].items()}
  widths = {w: load_width(folder, w, n) for w, n in params.items()}
  trend = decl["trend"]
  entries = [(c, True) for c in trend["claims"]] + [(c, False) for c in trend.get("descriptive", [])]
  outcomes = []
  for entry, is_claim in entries:
    label, plus, minus = parse_contrast(entry["contrast"])
    by_width, left_out, missing, diverged = {}, [], {}, {}
    for w, width in widths.items():
      ys, out, why, bad = points(width, plus, minus)
      by_width[w] = ys
      left_out += [(w, arm, seed, reason) for arm, seed, reason in out]
      if why:
        missing[w] = why
      if bad and width.decl.diverged == "inconclusive":
        diverged[w] = bad
    fit = _fit_of(by_width, params)
    reasons = not_judged(by_width, fit, need, diverged) if is_claim else []
    outcomes.append((Outcome(label, fit, by_width, left_out=tuple(left_out), missing=missing),
                     entry, is_claim, reasons))
  claims = [(o, reasons) for o, _, is_claim, reasons in outcomes if is_claim]
  # a claim not judged counts as p = 1 in Holm (as fp4jax.experiments.verdicts does)
  p = [1.0 if reasons else o.fit.slope_p() for o, reasons in claims]
  levels = hypothesis_tests.holm_levels(p, trend.get("alpha", 0.05))
  smallest = trend["smallest_slope"]
  done = []
  for i, (o, entry, is_claim, reasons) in enumerate(outcomes):
    if is_claim and not reasons:
      level = levels[i]
      lo, hi = o.fit.slope_interval(level)
      o = dataclasses.replace(o, interval=(lo, hi), level=level,
                              verdict=hypothesis_tests.decide(lo, hi, entry["direction"], smallest),
                              mde=o.fit.slope_mde(1 - level, 0.8))
    elif is_claim:
      o = dataclasses.replace(o, verdict=f"not judged ({'; '.join(reasons)})")
    done.append((o, entry))
  return decl, widths, done


def _extra(y) -> float:
  """Extra tokens exp(y) - 1 (inf beyond a float's range)."""
  try:
    return math.expm1(y)
  except OverflowError:
    return math.inf


def extra_text(y) -> str:
  return f"{_extra(y):+.1%}"


def declaration_lines(folder, widths, state, recorded_now) -> tuple:
  """([the EXPLORATORY line] or [], the sentence on the declarations): the
  umbrella declaration's status against FOLDER/declaration_record.json
  (`state`: declaration.status, before `recorded_now`), each width's against
  its own record."""
  path = os.path.join(folder, "DECLARATION.json")
  rec = declaration.read_record(folder) or {}
  when = rec.get("recorded_utc") or "at an unrecorded time"
  bad = []
  if state == "changed":
    bad.append(f"{path} changed after its SHA-256 was recorded in {declaration.RECORD} ({when})")
  elif state == "undeclared" and not recorded_now:
    bad.append(f"{path} has no record of its SHA-256 ({declaration.RECORD})")
  for w, width in widths.items():
    if width.state == "changed":
      bad.append(f"w{w}'s declaration changed after its first run began")
    elif width.state == "undeclared":
      bad.append(f"w{w}'s declaration was not recorded before its first run")
  banner = [f"**EXPLORATORY: {'; '.join(bad)}.** The rules that made these numbers are not "
            "the ones recorded when the study began.", ""] if bad else []
  umbrella = ("was recorded now, with the first trend (FOLDER/" + declaration.RECORD +
              "; an edit from now on marks the trend exploratory)" if recorded_now else
              f"matches the one recorded in {declaration.RECORD} ({when})"
              if state == "declared" else "does not match its record (above)")
  ok = _widths(w for w, width in widths.items() if width.state == "declared")
  sentence = (f"Declarations: the SHA-256 of the study's `DECLARATION.json` {umbrella}; " +
              (f"those of {ok} match the ones recorded before their first runs." if ok else
               "no width's declaration matches a record made before its first run."))
  return banner, sentence


def notes(decl, widths, done) -> list[str]:
  """Markdown lines after the table: the widths without points, the rule on
  how many widths a verdict needs, every run left out of a fit."""
  need = decl["trend"].get("min_widths", len(widths))
  rule = (f"A verdict needs points at all {len(widths)} declared widths (the declaration sets "
          "no trend.min_widths)" if need == len(widths) else
          f"A verdict needs points at {need} of the {len(widths)} declared widths "
          f"(trend.min_widths = {need})")
  lines = [f"{rule}; a claim not judged counts as p = 1 in Holm. Diverged runs count by each "
           "width's declaration (`diverged`: exclude leaves the seed out, inconclusive "
           "judges no claim with one); a seed is also left out where a run of it is not "
           "finished or has no partner. Widths without points, and runs left out:", ""]
  for w, width in widths.items():
    if width.withheld:
      lines.append(f"- w{w}: {width.withheld}.")
    for o, _ in done:
      why = o.missing.get(w)
      if why and why != width.withheld:
        lines.append(f"- w{w}: {o.label} has no points ({why}).")
  by_run = {}
  for o, _ in done:
    for w, arm, seed, why in o.left_out:
      by_run.setdefault((w, arm, seed, why), []).append(o.label)
  for (w, arm, seed, why), labels in by_run.items():
    rule = (f" (w{w} declares `diverged: {widths[w].decl.diverged}`)"
            if why.startswith("diverged") else "")
    lines.append(f"- w{w}: {arm} seed {seed} {why}: its seed is left out of "
                 f"{', '.join(labels)} at w{w}{rule}.")
  if lines[-1] == "":
    lines.append("- none: every declared width gives points and no run is left out.")
  return lines


def table(decl, widths, done, folder=None, state="declared", recorded_now=False) -> list[str]:
  """trend.md's lines (folder: where the declarations' records are read; None: not shown)."""
  params = {w: width.params for w, width in widths.items()}
  x8 = math.log(decl["design"]["parameters_at_8B"]["non_embedding"])
  banner, sentence = (declaration_lines(folder, widths, state, recorded_now) if folder
                      else ([], ""))
  widths_ = sorted(params)
  head = " | ".join(f"w{w} ({params[w]:,}): mean extra tokens, n" for w in widths_)
  lines = [f"# Trend of `{decl['study']}` against ln(non-embedding parameters)", ""] + banner + [
           "y per seed = paired late-mean contrast / (-baseline late slope at that width), shown as "
           "extra tokens exp(y) - 1. Slope: nats of ln(tokens) per e-fold of parameters, "
           f"t-interval at its Holm level; smallest slope of interest {decl['trend']['smallest_slope']}. "
           "At 8B: the fitted line and its 95% interval (an extrapolation beyond the widths).", ""]
  if sentence:
    lines += [sentence, ""]
  lines += [f"| contrast | {head} | slope [interval] | verdict | MDE | at 8B [95%] | paper (8B, C4) |",
            "|---|" + "---|" * len(widths_) + "---|---|---|---|---|"]
  for o, entry in done:
    cells = []
    for w in widths_:
      ys = list(o.by_width[w].values())
      cells.append(f"{extra_text(float(np.mean(ys)))}, n={len(ys)}" if ys else "-")
    if o.fit:
      y8, se8 = o.fit.line_at(x8)
      half = scipy_stats.t.ppf(0.975, o.fit.df) * se8
      at8 = f"{extra_text(y8)} [{extra_text(y8 - half)}, {extra_text(y8 + half)}]"
      slope = (f"{o.fit.slope:+.4f} [{o.interval[0]:+.4f}, {o.interval[1]:+.4f}] ({o.level:.2%})"
               if math.isfinite(o.level) else f"{o.fit.slope:+.4f} (no verdict)")
    else:
      at8, slope = "-", "-"
    mde = f"{o.mde:.4f}" if math.isfinite(o.mde) else "-"
    lines.append(f"| {entry['contrast']} | " + " | ".join(cells) +
                 f" | {slope} | {o.verdict or 'descriptive'} | {mde} | {at8} | {entry.get('paper', '')} |")
  return lines + [""] + notes(decl, widths, done)


def plot(path, decl, widths, done):
  """trend.png: one panel per contrast: per-seed points, per-width means, the line to 8B."""
  from fp4jax.experiments import figures  # pylint: disable=import-outside-toplevel
  plt = figures.plt
  params = {w: width.params for w, width in widths.items()}
  n8 = decl["design"]["parameters_at_8B"]["non_embedding"]
  fig, axes = plt.subplots(1, len(done), figsize=(4.2 * len(done), 3.6), squeeze=False)
  for ax, (o, entry) in zip(axes[0], done):
    for w, ys in o.by_width.items():
      ax.scatter([params[w]] * len(ys), [_extra(y) for y in ys.values()], s=10, alpha=0.5)
      if len(ys) > 1:
        i = stats.t_interval(list(ys.values()))
        ax.errorbar([params[w]], [_extra(i.mean)], color="k", capsize=3, fmt="o",
                    yerr=[[_extra(i.mean) - _extra(i.lo)], [_extra(i.hi) - _extra(i.mean)]])
    if o.fit:
      n_T = np.geomspace(min(params.values()), n8, 50)
      line = [o.fit.line_at(math.log(n)) for n in n_T]
      half = scipy_stats.t.ppf(0.975, o.fit.df)
      ax.plot(n_T, [_extra(y) for y, _ in line], "k-", lw=1)
      ax.fill_between(n_T, [_extra(y - half * s) for y, s in line],
                      [_extra(y + half * s) for y, s in line], color="k", alpha=0.1)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xscale("log")
    ax.set_title(entry["contrast"], fontsize=9)
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("extra tokens")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def written(path, write, what="the trend writes its record, trend.md and trend.png into "
            "the study folder"):
  """write(); an OSError (a read-only folder, a full disk) as a UserError
  naming `path` and `what` the command writes."""
  try:
    return write()
  except OSError as e:
    if errors.is_disk_full(e):
      raise errors.disk_full(path, None) from None
    raise errors.UserError(f"cannot write {path!r}: {e.strerror or e} ({what})") from None


def write(folder) -> str:
  """Records the umbrella declaration's SHA-256 in FOLDER/declaration_record.json
  if none is there; writes FOLDER/trend.md and trend.png; returns the text."""
  decl, widths, done = analyse(folder)
  path = os.path.join(folder, "DECLARATION.json")
  state = declaration.status(folder, path)
  if state == "undeclared":
    written(os.path.join(folder, declaration.RECORD),
             lambda: declaration.record(folder, path, check=read_declaration))
  text = "\n".join(table(decl, widths, done, folder, state, state == "undeclared")) + "\n"
  md = os.path.join(folder, "trend.md")

  def write_md():
    with open(md, "w") as f:
      f.write(text)

  written(md, write_md)
  png = os.path.join(folder, "trend.png")
  written(png, lambda: plot(png, decl, widths, done))
  return text


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m fp4jax.experiments.trend FOLDER")
  try:
    print(write(argv[1]), end="")
  except errors.UserError as e:
    return errors.report("python -m fp4jax.experiments.trend", e)
  return 0


if __name__ == "__main__":
  app.run(main)
