"""Tests over seeds by rules fixed in advance: Holm, sign flips, power.

Every function takes per-seed values of one paired contrast (one number per
seed, e.g. a recipe's late-half mean loss minus the baseline's of the same
seed) or their summary. Two-sided throughout: a directional claim is judged
by where a two-sided interval lies (`decide`).

  t_p_value      Student t-test of mean 0 (n - 1 degrees of freedom);
  sign_flip_p    exact randomisation test of a distribution symmetric about 0:
                 all 2^n sign patterns of the values (smallest possible p at
                 n seeds: 2 / 2^n, 0.0625 at n = 5);
  holm           Holm's step-down adjusted p-values over m hypotheses;
  holm_levels    the confidence level of each hypothesis's interval that
                 agrees with Holm's decisions (see there);
  mde            smallest true mean a two-sided t-test at level alpha detects
                 with the given power, for n seeds and spread sd (exact, from
                 the noncentral t distribution);
  log_slope      dL/d ln(tokens) of a curve's late part, which turns a
                 smallest effect in token units into nats (`effect_nats`);
  decide         supported / contradicted / inconclusive for one interval.
"""

import math

import numpy as np
from scipy import optimize
from scipy import stats as scipy_stats

DIRECTIONS = (">", "<", "!=")


def _finite(values) -> np.ndarray:
  return np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)


def t_p_value(values) -> float:
  """Two-sided p of the one-sample t-test of mean 0 (nan for n < 2; 0 or 1 for zero spread)."""
  v = _finite(values)
  if v.size < 2:
    return math.nan
  sd = v.std(ddof=1)
  if sd == 0:
    return 0.0 if v.mean() != 0 else 1.0
  t = v.mean() / (sd / math.sqrt(v.size))
  return float(2 * scipy_stats.t.sf(abs(t), v.size - 1))


def _pattern_sums(v) -> np.ndarray:
  """The 2^len(v) sums of +-v[0] +- v[1] ..., one per sign pattern."""
  sums = np.zeros(1)
  for x in v:
    sums = np.concatenate([sums + x, sums - x])
  return sums


def sign_flip_p(values, max_n=40) -> float:
  """Exact two-sided sign-flip p: the share of the 2^n sign patterns whose |mean| >= the observed.

  The observed pattern counts, so p >= 2 / 2^n. Exact by meeting in the
  middle: the pattern sums of each half of the values, one half sorted and
  searched for each sum of the other (2^(n/2) values a half, not 2^n).
  ValueError beyond max_n values.
  """
  v = _finite(values)
  if v.size == 0:
    return math.nan
  if v.size > max_n:
    raise ValueError(f"sign_flip_p counts 2^n patterns; n = {v.size} > {max_n}")
  bound = abs(v.sum()) * (1 - 1e-12)
  if bound == 0:
    return 1.0
  first, second = _pattern_sums(v[:v.size // 2]), np.sort(_pattern_sums(v[v.size // 2:]))
  # |a + b| >= bound: b >= bound - a, or b <= -bound - a (disjoint for bound > 0)
  above = second.size - np.searchsorted(second, bound - first, side="left")
  below = np.searchsorted(second, -bound - first, side="right")
  return float((above.sum() + below.sum()) / 2.0 ** v.size)


def holm(p_values) -> list[float]:
  """Holm-adjusted p-values, in the input order (nan stays nan and is not counted in m)."""
  p = np.asarray(p_values, np.float64)
  ok = np.nonzero(np.isfinite(p))[0]
  m = ok.size
  out = np.full(p.shape, np.nan)
  running = 0.0
  for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
    running = max(running, min(1.0, (m - rank) * p[i]))
    out[i] = running
  return out.tolist()


def holm_levels(p_values, alpha=0.05) -> list[float]:
  """Per hypothesis, the confidence level of its interval under Holm at family level alpha.

  Sorted by p, Holm rejects the first r hypotheses (p_(j) <= alpha / (m - j + 1)
  for every j <= r). A rejected one at rank j gets level 1 - alpha / (m - j + 1);
  the others 1 - alpha / (m - r), the level at which Holm stopped. A t-interval
  at that level then excludes 0 exactly when Holm rejects (for t p-values).
  """
  p = np.asarray(p_values, np.float64)
  ok = np.nonzero(np.isfinite(p))[0]
  m = ok.size
  order = ok[np.argsort(p[ok], kind="stable")]
  levels = np.full(p.shape, np.nan)
  rejected = 0
  for rank, i in enumerate(order):
    if p[i] > alpha / (m - rank):
      break
    levels[i] = 1 - alpha / (m - rank)
    rejected += 1
  for i in order[rejected:]:
    levels[i] = 1 - alpha / (m - rejected)
  return levels.tolist()


def power(effect, sd, n, alpha=0.05) -> float:
  """Power of the two-sided one-sample t-test at level alpha for a true mean `effect`."""
  df = n - 1
  crit = scipy_stats.t.ppf(1 - alpha / 2, df)
  nc = abs(effect) / (sd / math.sqrt(n))
  far = scipy_stats.nct.cdf(-crit, df, nc)  # the wrong tail; scipy gives nan once it is ~0
  return float(scipy_stats.nct.sf(crit, df, nc) + (0.0 if math.isnan(far) else far))


def mde(sd, n, alpha=0.05, target_power=0.8) -> float:
  """Smallest true mean the two-sided t-test at level alpha finds with `target_power`.

  sd: the per-seed spread (taken as the true one: with few seeds the MDE is
  itself uncertain); nan for n < 2 or sd not positive.
  """
  if n < 2 or not sd > 0:
    return math.nan
  hi = sd
  while power(hi, sd, n, alpha) < target_power:
    hi *= 2
  return float(optimize.brentq(lambda d: power(d, sd, n, alpha) - target_power, 0.0, hi,
                               xtol=1e-12 * sd))


def log_slope(tokens_T, loss_T, late_from=0.5) -> float:
  """b of loss = a + b ln(tokens) fitted to the evaluations at tokens >= late_from * last (nan if < 2)."""
  tokens_T, loss_T = np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)
  keep = (tokens_T > 0) & np.isfinite(loss_T) & (tokens_T >= late_from * tokens_T[-1])
  if keep.sum() < 2:
    return math.nan
  return float(np.polyfit(np.log(tokens_T[keep]), loss_T[keep], 1)[0])


def effect_nats(slope, extra_tokens) -> float:
  """The loss a baseline with slope dL/d ln(tokens) gains from (1 + extra_tokens) x its tokens."""
  return float(-slope * math.log1p(extra_tokens))


def decide(lo, hi, direction, smallest) -> str:
  """The verdict on a claim from its (adjusted) interval [lo, hi].

  ">": supported when lo > 0; contradicted when hi < smallest (an effect of
  the claimed sign as large as the smallest effect of interest is ruled out).
  "<": the mirror image. "!=": supported when the interval excludes 0,
  contradicted when it lies inside (-smallest, smallest). Else inconclusive.
  """
  if not (math.isfinite(lo) and math.isfinite(hi)):
    return "inconclusive"
  if direction == ">":
    return "supported" if lo > 0 else "contradicted" if hi < smallest else "inconclusive"
  if direction == "<":
    return "supported" if hi < 0 else "contradicted" if lo > -smallest else "inconclusive"
  if direction == "!=":
    if lo > 0 or hi < 0:
      return "supported"
    return "contradicted" if -smallest < lo and hi < smallest else "inconclusive"
  raise ValueError(f"unknown direction {direction!r}; allowed: {', '.join(DIRECTIONS)}")
