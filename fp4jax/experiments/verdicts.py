"""The verdict on each declared claim, from per-seed values of the primary statistic.

`evaluate(decl, primary, smallest, diverged)`: primary {recipe: {seed: value}}
(the declaration's primary statistic of each run), smallest the smallest
effect of interest in nats, diverged the (recipe, seed) of the runs that
diverged (a non-finite value counts as diverged too). Per contrast: its
per-seed values, the t-test and exact sign-flip p-values; per claim: p = the
largest of its contrasts' t p-values, Holm over the claims, and each
contrast's t-interval at the level Holm gives its claim
(`hypothesis_tests.holm_levels`), judged by `hypothesis_tests.decide`, with
the minimum detectable effect at the declared power and that level
(`contrast_split`: a contrast's seeds, values and diverged runs). A
diverged run counts by the declaration's rule (`decl.diverged`): "exclude"
leaves its seed out of the contrast; "inconclusive" judges no claim with one
(and so does "exclude" when fewer than 2 seeds are left), its p taken as 1 in
Holm. `lines(results, smallest)`: one markdown line per claim, with the seeds
each contrast stands on and the runs left out.
"""

import dataclasses
import math

import numpy as np

from fp4jax.experiments import hypothesis_tests
from fp4jax.experiments import stats


@dataclasses.dataclass(frozen=True)
class ContrastResult:
  label: str
  direction: str
  interval: stats.Interval  # at the claim's Holm level
  t_p: float
  flip_p: float
  mde: float
  verdict: str
  seeds: int = 0  # where every arm of the contrast ran (interval.n of them kept)
  diverged: tuple = ()  # (arm, seed) of its runs that diverged


@dataclasses.dataclass(frozen=True)
class ClaimResult:
  text: str
  contrasts: tuple  # of ContrastResult; () when a recipe did not run
  p: float
  p_holm: float
  level: float
  verdict: str
  judged: bool = True  # False: a diverged run keeps it from a verdict (p = 1 in Holm)


def _claim_verdict(verdicts):
  if verdicts and all(v == "supported" for v in verdicts):
    return "supported"
  return "contradicted" if "contradicted" in verdicts else "inconclusive"


def _largest(p_values):
  """The largest p (intersection-union), nan when one contrast has none."""
  return max(p_values) if all(math.isfinite(p) for p in p_values) else math.nan


def contrast_split(contrast, primary, diverged=frozenset()):
  """(the contrast's seeds, its values on those without a diverged run, the
  (arm, seed) of its diverged runs)."""
  seeds = stats.contrast_seeds(contrast, primary)
  bad = [(a, s) for s in seeds for a in contrast.weights
         if (a, s) in diverged or not math.isfinite(primary[a][s])]
  kept = [s for s in seeds if s not in {s for _, s in bad}]
  return seeds, stats.contrast_values(contrast, primary, kept), tuple(bad)


def evaluate(decl, primary, smallest, diverged=frozenset()) -> list[ClaimResult]:
  """ClaimResults in the declaration's order (see the module docstring)."""
  splits = [[contrast_split(c, primary, diverged) for c in claim.contrasts]
            for claim in decl.claims]
  ran = [all(seeds for seeds, _, _ in sp) for sp in splits]
  claim_p = [_largest([hypothesis_tests.t_p_value(v) for _, v, _ in sp]) if ok else math.nan
             for sp, ok in zip(splits, ran)]
  judged = [not any(bad for _, _, bad in sp) or (
      decl.diverged == "exclude" and math.isfinite(p)) for sp, p in zip(splits, claim_p)]
  claim_p = [p if j or not ok else 1.0 for p, j, ok in zip(claim_p, judged, ran)]
  p_holm = hypothesis_tests.holm(claim_p)
  levels = hypothesis_tests.holm_levels(claim_p, decl.alpha)
  out = []
  for claim, sp, ok, j, p, ph, level in zip(decl.claims, splits, ran, judged, claim_p, p_holm,
                                            levels):
    if not ok:
      out.append(ClaimResult(claim.text, (), math.nan, math.nan, math.nan, "not run"))
      continue
    results = []
    for contrast, (seeds, v, bad) in zip(claim.contrasts, sp):
      interval = stats.t_interval(v, level) if math.isfinite(level) else stats.t_interval(v)
      sd = float(np.std(v, ddof=1)) if len(v) > 1 else math.nan
      verdict = hypothesis_tests.decide(interval.lo, interval.hi, contrast.direction, smallest)
      results.append(ContrastResult(
          contrast.label, contrast.direction, interval, hypothesis_tests.t_p_value(v),
          hypothesis_tests.sign_flip_p(v), hypothesis_tests.mde(sd, len(v), 1 - level, decl.power)
          if math.isfinite(level) else math.nan,
          verdict if j else "inconclusive", len(seeds), bad))
    out.append(ClaimResult(claim.text, tuple(results), p, ph, level,
                           _claim_verdict([r.verdict for r in results]), j))
  return out


def fmt_p(p):
  return "-" if not math.isfinite(p) else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _nats(x, fmt="+.4f"):
  return f"{x:{fmt}}" if math.isfinite(x) else "-"


def _seeds_text(c):
  """"n=N", or with diverged runs the seeds kept of those run and the runs left out."""
  if not c.diverged:
    return f"n={c.interval.n}"
  runs = ", ".join(f"{arm} seed {seed}" for arm, seed in c.diverged)
  return f"n={c.interval.n} of {c.seeds} seeds; diverged, left out: {runs}"


def lines(results, smallest, power=0.8) -> list[str]:
  """Markdown, one line per claim: verdict, Holm p, then per contrast its numbers."""
  out = []
  for r in results:
    if r.verdict == "not run":
      out.append(f"- **not run**: {r.text} (a recipe of its contrasts has no runs).")
      continue
    parts = []
    for c in r.contrasts:
      seen = ("could have seen" if c.mde <= smallest else "could NOT have seen") \
          if math.isfinite(c.mde) else "power unknown"
      parts.append(
          f"{c.label} = {_nats(c.interval.mean)} [{_nats(c.interval.lo)}, "
          f"{_nats(c.interval.hi)}] nats (claim {c.direction} 0: {c.verdict}; t p = "
          f"{fmt_p(c.t_p)}, sign-flip p = {fmt_p(c.flip_p)}; MDE at {power:.0%} power "
          f"{_nats(c.mde, '.4f')} nats: the design {seen} {smallest:.4f}; {_seeds_text(c)})")
    p = (f"Claim p = {fmt_p(r.p)}" if r.judged else
         "Not judged: a run diverged (claim p taken as 1)")
    out.append(f"- **{r.verdict}**: {r.text}. {p}, Holm-adjusted "
               f"{fmt_p(r.p_holm)}; {r.level:.2%} intervals. " + "; ".join(parts) + ".")
  return out
