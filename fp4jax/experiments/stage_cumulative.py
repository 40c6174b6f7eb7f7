"""E5's declared reading over its horizons: each horizon's claims, the horizon contrast, the family.

  python -m fp4jax.experiments.stage_cumulative results/stage_cumulative

FOLDER/DECLARATION.json is one declaration for every horizon: the keys of
fp4jax.experiments.declaration (the runner's report judges each horizon's
folder by them), `design.horizons` {H: ...} (H in tokens per non-embedding
parameter; its runs in FOLDER/tppH) and `horizon_contrast` (its label
"LABEL = (A - B at H2) - (A - B at H1)", direction, and the level of its
statistic, "(alpha X)").

Per horizon, from its runs:
  claims       the declaration's claims as the runner's report judges them
               (report.judge: Holm over them at the declaration's alpha);
  validity     the declared checks that each arm quantizes what it should
               (`validity`);
  stage costs  each arm against the baseline, and FD - F, in extra tokens,
               95% t-intervals (descriptive), and tokens to target beside
               (report.summarize; the median over seeds, misses as never).
The horizon contrast: per seed and horizon, y = (late mean of A - late mean
of B) / (-B's late slope at that horizon, mean over its seeds), the ln of
the extra tokens (fp4jax.experiments.trend.points); per seed HC = y(H2) -
y(H1), on the seeds with both; its Student t-interval at 1 - alpha, the
exact sign-flip p and the MDE, judged by hypothesis_tests.decide against
ln(1 + smallest_effect_tokens). A seed whose run of A or B diverged, is not
finished or has no partner at either horizon is left out and named.

Under L = E + A (N eff_N)^-a + B (D eff_D)^-b, a data-efficiency cost
(eff_D: a token multiplier) gives the same y at every horizon, so HC ~ 0; a
parameter-efficiency cost (eff_N: a loss offset) costs more tokens where
fp8's curve is flatter, so HC > 0 (tests/test_stage_cumulative.py plants
both).

The family, as declared: each horizon's claims at the declaration's alpha
(Holm inside it), HC at its own alpha, Bonferroni over the parts. Holm over
all the unadjusted p-values at the sum of the parts' alphas is printed
beside, exploratory. A horizon folder whose declaration record
(declaration_record.json, written by the runner before its first run) is
missing or does not match marks the reading EXPLORATORY.

Writes FOLDER/stage_cumulative.md and prints it; with no runs at any
horizon it says "no runs yet" and writes nothing. Bad input: one line,
exit status 2.
"""

import dataclasses
import json
import math
import os
import re
import sys

import numpy as np

from fp4jax import errors
from fp4jax import records
from fp4jax.experiments import declaration as declaration_lib
from fp4jax.experiments import horizon as horizon_lib
from fp4jax.experiments import hypothesis_tests
from fp4jax.experiments import report
from fp4jax.experiments import stats
from fp4jax.experiments import trend
from fp4jax.experiments import verdicts
from fp4jax.train import atomic

OUTPUT = "stage_cumulative.md"
_PROG = "python -m fp4jax.experiments.stage_cumulative"
# The declared validity rule's operands (DECLARATION.json "validity").
MXFP4_WGRAD, FP8_WGRAD = ("FDW", "FDWH"), "FD"
MXFP4_FPROP, MXFP4_DGRAD = ("F", "FD"), ("FD",)
REF_OUT_ERR = {"fprop": ("ref", "fprop", "out_err"), "dgrad": ("ref", "dgrad", "out_err")}
# Descriptive: each arm against the baseline, and Dgrad's stage.
STAGE_INCREMENTS = (("FD", "F"),)
_LABEL = re.compile(r"\s*(\S+)\s*=\s*\((.+) - (.+) at (\S+)\)\s*-\s*\((.+) - (.+) at (\S+)\)\s*")


@dataclasses.dataclass(frozen=True)
class UmbrellaDeclaration:
  """the keys a study over horizons adds to a declaration"""
  study: str
  design: dict
  horizon_contrast: dict


@dataclasses.dataclass(frozen=True)
class ContrastSpec:
  """HC = (plus - minus at long) - (plus - minus at short), `direction`, level 1 - alpha."""
  label: str
  plus: str
  minus: str
  long: str
  short: str
  direction: str
  alpha: float


def parse_contrast(entry, path) -> ContrastSpec:
  """The ContrastSpec of the declaration's `horizon_contrast`; UserError naming what is wrong."""
  match = _LABEL.fullmatch(entry.get("label", ""))
  if not match:
    raise errors.UserError(f"{path}: horizon_contrast.label {entry.get('label')!r} is not "
                           "'LABEL = (A - B at H2) - (A - B at H1)'")
  label, plus, minus, long, plus2, minus2, short = match.groups()
  if (plus, minus) != (plus2, minus2):
    raise errors.UserError(f"{path}: horizon_contrast.label pairs {plus} - {minus} with "
                           f"{plus2} - {minus2}; both horizons need the same contrast")
  alpha = re.search(r"\(alpha ([0-9.]+)\)", entry.get("statistic", ""))
  if not alpha or not 0 < float(alpha.group(1)) < 1:
    raise errors.UserError(f"{path}: horizon_contrast.statistic names no level '(alpha X)' "
                           "with X in (0, 1)")
  if entry.get("direction") not in hypothesis_tests.DIRECTIONS:
    raise errors.UserError(f"{path}: horizon_contrast.direction {entry.get('direction')!r} is "
                           f"not one of {', '.join(hypothesis_tests.DIRECTIONS)}")
  return ContrastSpec(label, plus.strip(), minus.strip(), long, short, entry["direction"],
                      float(alpha.group(1)))


@dataclasses.dataclass(frozen=True)
class Check:
  """One declared validity check: what, the numbers, met (None: not measured)."""
  text: str
  numbers: str
  met: bool | None


def _ratio(a, b) -> float:
  return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def _times(ratio) -> str:
  return f"{ratio:.2f}x" if math.isfinite(ratio) else "-"


def _judged(value, rule) -> bool | None:
  return None if not math.isfinite(value) else bool(rule(value))


def validity(runs, baseline="fp8") -> list[Check]:
  """The declared checks at one horizon ({arm: [report.Run]}): MXFP4 Wgrad
  in FDW and FDWH (their Wgrad operand errors X and dY on the training
  batch, mean over seeds, steps and layers, >= 2x the baseline's), not in FD
  (within 10% of the baseline's); MXFP4 Fprop in F and FD and MXFP4 Dgrad in
  FD (the output error on the reference batch >= 2x the baseline's); the
  baseline trains (its final validation loss >= 1 nat below its step-0
  evaluation on every seed)."""
  base = horizon_lib.operand_errors(runs.get(baseline, []))
  checks = []
  for arm in MXFP4_WGRAD + (FP8_WGRAD,):
    ratios = [_ratio(horizon_lib.operand_errors(runs.get(arm, []))[k], base[k])
              for k in ("lhs_err", "rhs_err")]
    numbers = f"X {_times(ratios[0])}, dY {_times(ratios[1])} {baseline}'s"
    if arm == FP8_WGRAD:
      met = [_judged(r, lambda r: abs(r - 1) <= 0.10) for r in ratios]
      text = f"{arm}'s Wgrad operand errors within 10% of {baseline}'s"
    else:
      met = [_judged(r, lambda r: r >= 2) for r in ratios]
      text = f"{arm}'s Wgrad operand errors >= 2x {baseline}'s"
    checks.append(Check(text, numbers, None if None in met else all(met)))
  errs = report.diag_summary(runs, REF_OUT_ERR)
  for role, arms in (("fprop", MXFP4_FPROP), ("dgrad", MXFP4_DGRAD)):
    for arm in arms:
      ratio = _ratio(*((errs.get(a, {}).get(role) or math.nan) for a in (arm, baseline)))
      checks.append(Check(f"{arm}'s {role.capitalize()} output error (reference batch) >= 2x "
                          f"{baseline}'s", _times(ratio), _judged(ratio, lambda r: r >= 2)))
  drops = []
  for run in runs.get(baseline, []):
    steps, loss = horizon_lib.eval_curve(run)
    drops.append(loss[0] - loss[-1] if steps.size and steps[0] == 0 else math.nan)
  least = min(drops) if drops and all(math.isfinite(d) for d in drops) else math.nan
  shown = f"least drop {least:.2f} nats over {len(drops)} seeds" if drops else "no runs of it"
  checks.append(Check(f"{baseline} trains: final validation loss >= 1 nat below step 0 on "
                      "every seed", shown,
                      _judged(least, lambda d: d >= 1)))
  return checks


def validity_verdict(checks) -> str:
  if any(c.met is False for c in checks):
    return "not met"
  return "met" if all(c.met for c in checks) else "not measured"


@dataclasses.dataclass(frozen=True)
class Horizon:
  """One horizon: its folder, its study (trend.Width: runs, declaration,
  status, the baseline's late slope), the claims' verdicts, the smallest
  effect in nats, the validity checks (all empty without runs)."""
  name: str
  folder: str
  study: trend.Width
  claims: list
  smallest: float
  checks: list


def load_horizon(folder, name, path) -> Horizon:
  """The Horizon of FOLDER/tpp<name>, judged by the declaration `path`."""
  sub = os.path.join(folder, f"tpp{name}")
  study = trend.load_study(sub, path=path)
  if not study.runs:
    return Horizon(name, sub, study, [], math.nan, [])
  _, smallest, claims, _ = report.judge(study.runs, study.decl)
  return Horizon(name, sub, study, claims, smallest, validity(study.runs, study.decl.baseline))


@dataclasses.dataclass(frozen=True)
class ContrastOutcome:
  """The horizon contrast: per-seed values {seed: HC}, interval at 1 - alpha,
  p-values, MDE, verdict (or why it is not judged), runs left out
  [(horizon, arm, seed, why)]."""
  values: dict
  interval: stats.Interval
  t_p: float
  flip_p: float
  mde: float
  verdict: str
  left_out: tuple


def horizon_contrast(spec, horizons, smallest, power=0.8) -> ContrastOutcome:
  """The declared horizon contrast over {name: Horizon} (module docstring)."""
  ys, left_out, missing = {}, [], []
  for name in (spec.short, spec.long):
    h = horizons[name]
    if not h.study.runs:
      missing.append(f"no runs yet at {name}")
      ys[name] = {}
      continue
    ys[name], out, why, _ = trend.points(h.study, spec.plus, spec.minus)
    left_out += [(name, arm, seed, reason) for arm, seed, reason in out]
    if why:
      missing.append(f"no points at {name} ({why})")
  seeds = sorted(set(ys[spec.short]) & set(ys[spec.long]))
  for name, other in ((spec.short, spec.long), (spec.long, spec.short)):
    left_out += [(name, f"{spec.plus} - {spec.minus}", s, f"has no point at {other} to pair with")
                 for s in sorted(set(ys[name]) - set(seeds)) if ys[other]]
  values = {s: ys[spec.long][s] - ys[spec.short][s] for s in seeds}
  v = list(values.values())
  interval = stats.t_interval(v, 1 - spec.alpha)
  sd = float(np.std(v, ddof=1)) if len(v) > 1 else math.nan
  if len(v) < 2:
    verdict = "not judged (" + ("; ".join(missing) or f"{len(v)} seed with both horizons") + ")"
  else:
    verdict = hypothesis_tests.decide(interval.lo, interval.hi, spec.direction, smallest)
  return ContrastOutcome(values, interval, hypothesis_tests.t_p_value(v),
                         hypothesis_tests.sign_flip_p(v), hypothesis_tests.mde(
                             sd, len(v), spec.alpha, power), verdict, tuple(left_out))


def _pct(y) -> str:
  return trend.extra_text(y) if math.isfinite(y) else "-"


def _paper(folder) -> dict:
  """{arm: the paper's extra tokens vs FP8} of the arms that are a preset
  (FOLDER/arms.json, the runner's record of them); {} without one."""
  path = os.path.join(folder, "arms.json")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    arms = json.load(f)
  return {arm: report.PAPER.get(entry.get("recipe", ""), "") for arm, entry in arms.items()}


def stage_lines(h) -> list[str]:
  """Markdown: each arm against the baseline and STAGE_INCREMENTS in extra
  tokens (95% t-intervals over seeds, descriptive), with tokens to target."""
  runs, base = h.study.runs, h.study.decl.baseline
  # tokens to target need the baseline's runs (the target is its loss at 75% of its tokens)
  ttt = {r.recipe: r for r in report.summarize(runs, base, target_at=0.75)[0]} if (
      runs.get(base)) else {}
  paper = _paper(h.folder)
  lines = [f"| contrast | extra tokens, mean [95%] | seeds | tokens to target: median overhead "
           f"(reached) | paper (8B, C4) |", "|---|---|---|---|---|"]
  pairs = [(a, base) for a in runs if a != base] + [p for p in STAGE_INCREMENTS
                                                     if all(a in runs for a in p)]
  for plus, minus in pairs:
    ys = list(trend.points(h.study, plus, minus)[0].values())
    i = stats.t_interval(ys)
    cell = (f"{_pct(i.mean)} [{_pct(i.lo)}, {_pct(i.hi)}]" if i.n > 1 else _pct(i.mean))
    row = ttt.get(plus) if minus == base else None
    overhead = "-" if row is None else (
        ("undefined" if row.overhead is None else f"{100 * row.overhead:+.1f}%")
        + f" ({row.reached}/{row.n})")
    lines.append(f"| {plus} - {minus} | {cell} | {i.n} | {overhead} | "
                 f"{paper.get(plus, '') if minus == base else ''} |")
  return lines


def _where(h) -> str:
  """"FOLDER holds none" or "FOLDER does not exist" (a horizon without runs)."""
  return f"{h.folder} " + ("holds none" if os.path.isdir(h.folder) else "does not exist")


def horizon_lines(h) -> list[str]:
  """Markdown of one horizon: its runs, validity, claims and stage costs."""
  lines = ["", f"## {h.name} tokens per non-embedding parameter (`{h.folder}`)", ""]
  if not h.study.runs:
    return lines + [f"No runs yet: {_where(h)}."]
  decl, runs = h.study.decl, h.study.runs
  finished = sum(r.finished for rs in runs.values() for r in rs)
  total = sum(len(rs) for rs in runs.values())
  seeds = ", ".join(f"{arm} {len(rs)}" for arm, rs in runs.items())
  lines += [f"Runs: {total} ({finished} finished); seeds per arm: {seeds}. "
            f"{decl.baseline}'s late slope dL/d ln(tokens) {h.study.slope:+.4f}: the smallest "
            f"effect, {decl.smallest_effect_tokens:.0%} more tokens, is {h.smallest:.4f} nats.",
            ""]
  state = validity_verdict(h.checks)
  lines.append(f"Validity (declared, read before the claims): **{state}**." + (
      " The claims below are read with that caveat." if state != "met" else ""))
  lines += [f"- {c.text}: {c.numbers} "
            f"({'met' if c.met else 'not measured' if c.met is None else 'NOT met'})"
            for c in h.checks]
  lines += ["", f"Claims ({decl.correction.capitalize()} over the {len(decl.claims)} at "
            f"alpha {decl.alpha}; late-mean contrasts in nats):", ""]
  lines += verdicts.lines(h.claims, h.smallest, decl.power)
  lines += ["", "Stage costs (descriptive, no verdicts): per seed the late-mean contrast over "
            f"-{decl.baseline}'s late slope, shown as extra tokens exp(y) - 1; tokens to "
            f"{decl.baseline}'s loss at 75% of its tokens beside.", ""] + stage_lines(h)
  return lines


def contrast_lines(spec, outcome, smallest, power) -> list[str]:
  """Markdown of the horizon contrast."""
  i = outcome.interval
  lines = ["", f"## The horizon contrast {spec.label}", "",
           f"{spec.label} = ({spec.plus} - {spec.minus} at {spec.long}) - ({spec.plus} - "
           f"{spec.minus} at {spec.short}), per seed in ln(tokens) (each horizon's late-mean "
           f"contrast over -{spec.minus}'s late slope there). Claim {spec.direction} 0 at alpha "
           f"{spec.alpha} (Student t-interval at {1 - spec.alpha:.0%}); smallest effect "
           f"{smallest:.4f} (ln of {math.exp(smallest):.2f}). A token multiplier flat in "
           "tokens per parameter (a data-efficiency cost) gives 0; a cost that grows with them "
           "(a parameter-efficiency cost) gives > 0.", ""]
  if i.n >= 2:
    lines.append(f"- **{outcome.verdict}**: {spec.label} = {i.mean:+.4f} [{i.lo:+.4f}, "
                 f"{i.hi:+.4f}] ln(tokens), {_pct(i.mean)} [{_pct(i.lo)}, {_pct(i.hi)}] in "
                 f"tokens; t p = {verdicts.fmt_p(outcome.t_p)}, sign-flip p = "
                 f"{verdicts.fmt_p(outcome.flip_p)}; MDE at {power:.0%} power "
                 f"{outcome.mde:.4f}; n = {i.n} seeds.")
  else:
    lines.append(f"- **{outcome.verdict}**.")
  for name, arm, seed, why in outcome.left_out:
    lines.append(f"- left out: {arm} seed {seed} at {name} {why}.")
  return lines


def family_lines(horizons, spec, outcome, decl) -> list[str]:
  """Markdown: every claim's unadjusted p, the declared verdict and Holm over all (exploratory)."""
  rows = [(f"{c.text.partition(':')[0]} at {name}", c.p, decl.alpha, c.verdict)
          for name, h in horizons.items() for c in h.claims]
  rows.append((f"{spec.label.split(' =')[0]} ({spec.long} vs {spec.short})", outcome.t_p,
               spec.alpha, outcome.verdict))
  total = decl.alpha * len(horizons) + spec.alpha
  adjusted = hypothesis_tests.holm([p for _, p, _, _ in rows])
  lines = ["", "## The family", "",
           f"Declared: each horizon's claims by Holm at alpha {decl.alpha}, the horizon "
           f"contrast at {spec.alpha}; Bonferroni over the parts, family-wise error <= "
           f"{total:g}. Beside, exploratory: Holm over the {len(rows)} unadjusted p-values at "
           f"{total:g} (not the declared rule).", "",
           "| claim | unadjusted p | declared part's alpha | declared verdict | Holm over all "
           "(exploratory) |", "|---|---|---|---|---|"]
  for (name, p, alpha, verdict), adj in zip(rows, adjusted):
    flag = f" (<= {total:g})" if adj <= total else ""
    lines.append(f"| {name} | {verdicts.fmt_p(p)} | {alpha} | {verdict} | "
                 f"{verdicts.fmt_p(adj)}{flag} |")
  return lines


def read(folder) -> tuple:
  """(the declaration as read, its Declaration, the ContrastSpec, {horizon: Horizon})."""
  path = os.path.join(folder, "DECLARATION.json")
  if not os.path.isfile(path):
    raise errors.UserError(f"{path!r} does not exist; give the folder of a study over "
                           "horizons (one with the DECLARATION.json of its design.horizons)")
  raw = records.read(UmbrellaDeclaration, path)
  decl = declaration_lib.load(path)
  spec = parse_contrast(raw["horizon_contrast"], path)
  names = sorted(raw["design"].get("horizons", {}), key=float)
  unknown = [h for h in (spec.short, spec.long) if h not in names]
  if unknown:
    raise errors.UserError(f"{path}: horizon_contrast names horizon(s) {', '.join(unknown)}; "
                           f"design.horizons has {', '.join(names) or 'none'}")
  return raw, decl, spec, {h: load_horizon(folder, h, path) for h in names}


def text(folder) -> tuple:
  """(the reading's markdown, whether any horizon has runs)."""
  raw, decl, spec, horizons = read(folder)
  if not any(h.study.runs for h in horizons.values()):
    where = "; ".join(_where(h) for h in horizons.values())
    return (f"{raw['study']}: no runs yet ({where}). Start them with the declaration's "
            f"design.command.\n"), False
  smallest = math.log1p(decl.smallest_effect_tokens)
  outcome = horizon_contrast(spec, horizons, smallest, decl.power)
  bad = [f"{h.folder}: " + ("no declaration record" if h.study.state == "undeclared" else
                            "the declaration changed after its first run")
         for h in horizons.values() if h.study.runs and h.study.state != "declared"]
  banner = ([f"**EXPLORATORY: {'; '.join(bad)}.** The rules that made these numbers are not "
             "the ones recorded when the runs began.", ""] if bad else [])
  lines = [f"# `{raw['study']}`: the declared claims at each horizon and the horizon contrast",
           ""] + banner + [
           f"Declaration `{os.path.join(folder, 'DECLARATION.json')}` (its SHA-256 "
           f"{declaration_lib.file_hash(os.path.join(folder, 'DECLARATION.json'))[:12]}...). "
           "Diverged runs count by its rule `diverged: " + decl.diverged + "`: " +
           declaration_lib.DIVERGED[decl.diverged] + "."]
  for h in horizons.values():
    lines += horizon_lines(h)
  lines += contrast_lines(spec, outcome, smallest, decl.power)
  lines += family_lines({n: h for n, h in horizons.items() if h.claims}, spec, outcome, decl)
  return "\n".join(lines) + "\n", True


def write(folder) -> str:
  """Writes FOLDER/stage_cumulative.md when a horizon has runs; returns the text."""
  out, any_runs = text(folder)
  if any_runs:
    path = os.path.join(folder, OUTPUT)
    trend.written(path, lambda: atomic.write_text(path, out),
                  f"{_PROG} writes {OUTPUT} into the study folder")
  return out


def main(argv):
  usage = f"usage: {_PROG} FOLDER (a study over horizons, e.g. results/stage_cumulative)"
  if argv[1:] in (["-h"], ["--help"]):
    print(usage)
    return 0
  if len(argv) != 2 or argv[1].startswith("-"):
    print(f"{_PROG}: {usage}", file=sys.stderr)
    return 2
  try:
    print(write(argv[1]), end="")
  except errors.UserError as e:
    return errors.report(_PROG, e)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
