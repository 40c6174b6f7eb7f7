"""The verdict on each declared claim, from per-seed values of the primary statistic.

`evaluate(decl, primary, smallest)`: primary {recipe: {seed: value}} (the
declaration's primary statistic of each run), smallest the smallest effect of
interest in nats. Per contrast: its per-seed values, the t-test and exact
sign-flip p-values; per claim: p = the largest of its contrasts' t p-values,
Holm over the claims, and each contrast's t-interval at the level Holm gives
its claim (`hypothesis_tests.holm_levels`), judged by `hypothesis_tests.decide`, with the
minimum detectable effect at the declared power and that level.
`lines(results, smallest)`: one markdown line per claim.
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


@dataclasses.dataclass(frozen=True)
class ClaimResult:
  text: str
  contrasts: tuple  # of ContrastResult; () when a recipe did not run
  p: float
  p_holm: float
  level: float
  verdict: str


def _claim_verdict(verdicts):
  if verdicts and all(v == "supported" for v in verdicts):
    return "supported"
  return "contradicted" if "contradicted" in verdicts else "inconclusive"


def evaluate(decl, primary, smallest) -> list[ClaimResult]:
  """ClaimResults in the declaration's order (see the module docstring)."""
  values = [[stats.contrast_values(c, primary) for c in claim.contrasts] for claim in decl.claims]
  ran = [all(len(v) > 0 for v in vs) for vs in values]
  claim_p = [max(hypothesis_tests.t_p_value(v) for v in vs) if ok else math.nan
             for vs, ok in zip(values, ran)]
  p_holm = hypothesis_tests.holm(claim_p)
  levels = hypothesis_tests.holm_levels(claim_p, decl.alpha)
  out = []
  for claim, vs, ok, p, ph, level in zip(decl.claims, values, ran, claim_p, p_holm, levels):
    if not ok:
      out.append(ClaimResult(claim.text, (), math.nan, math.nan, math.nan, "not run"))
      continue
    results = []
    for contrast, v in zip(claim.contrasts, vs):
      finite = [x for x in v if math.isfinite(x)]
      interval = stats.t_interval(finite, level) if math.isfinite(level) else stats.t_interval(
          finite)
      sd = float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan
      results.append(ContrastResult(
          contrast.label, contrast.direction, interval, hypothesis_tests.t_p_value(finite),
          hypothesis_tests.sign_flip_p(finite), hypothesis_tests.mde(sd, len(finite), 1 - level, decl.power)
          if math.isfinite(level) else math.nan,
          hypothesis_tests.decide(interval.lo, interval.hi, contrast.direction, smallest)))
    out.append(ClaimResult(claim.text, tuple(results), p, ph, level,
                           _claim_verdict([r.verdict for r in results])))
  return out


def _fmt_p(p):
  return "-" if not math.isfinite(p) else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


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
          f"{c.label} = {c.interval.mean:+.4f} [{c.interval.lo:+.4f}, {c.interval.hi:+.4f}] "
          f"nats (claim {c.direction} 0: {c.verdict}; t p = {_fmt_p(c.t_p)}, sign-flip p = "
          f"{_fmt_p(c.flip_p)}; MDE at {power:.0%} power {c.mde:.4f} nats: the design "
          f"{seen} {smallest:.4f}; n={c.interval.n})")
    out.append(f"- **{r.verdict}**: {r.text}. Claim p = {_fmt_p(r.p)}, Holm-adjusted "
               f"{_fmt_p(r.p_holm)}; {r.level:.2%} intervals. " + "; ".join(parts) + ".")
  return out
