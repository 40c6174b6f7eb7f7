"""Paired estimates with confidence intervals over seeds.

Every recipe of a seed sees the same initialisation and data order, so each
recipe is compared with the baseline (or another recipe) of the same seed and
the intervals are over seeds: a Student t-interval of the per-seed values
(`t_interval`; n - 1 degrees of freedom, no interval with one seed).

Per-seed estimates:
  late mean              the mean validation loss over the evaluations of the
                         late part of training (`late_mean`);
  final-loss difference  the recipe's final validation loss minus the other's;
  token multiplier       how many times the tokens the baseline needs to reach
                         the loss the recipe reaches (`token_multiplier`):
                         for each of the recipe's evaluations in the late part
                         of training, the tokens at which the baseline reaches
                         that loss, the ratio of the two token counts, and the
                         geometric mean of the ratios (1.10 = the recipe needs
                         10% more tokens). The baseline is read off its
                         monotone-smoothed curve (`BaselineCurve`) or a fitted
                         L = E + A t^-alpha (`PowerLawCurve`).
`contrast_values` gives a linear contrast of per-seed values (e.g. the Wgrad
increment minus the Dgrad increment); fp4jax.experiments.verdicts judges them.
"""

import dataclasses
import math

import numpy as np
from scipy import optimize
from scipy import stats as scipy_stats

LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
  """mean and [lo, hi], a t-interval over n per-seed values (lo = hi = nan for n < 2)."""
  mean: float
  lo: float
  hi: float
  n: int

  def __str__(self):
    if not math.isfinite(self.mean):
      return "-"
    if self.n < 2:
      return f"{self.mean:+.4f} (1 seed, no interval)"
    return f"{self.mean:+.4f} [{self.lo:+.4f}, {self.hi:+.4f}]"

  def contains(self, value) -> bool:
    return self.lo <= value <= self.hi


def t_interval(values, level=LEVEL) -> Interval:
  """Mean of the finite `values` and its two-sided `level` Student t-interval."""
  values = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
  n = values.size
  if n == 0:
    return Interval(math.nan, math.nan, math.nan, 0)
  mean = float(values.mean())
  if n < 2:
    return Interval(mean, math.nan, math.nan, 1)
  half = float(scipy_stats.t.ppf(0.5 + level / 2, n - 1) * values.std(ddof=1) / math.sqrt(n))
  return Interval(mean, mean - half, mean + half, n)


# ------------------------------------------------------------ token multiplier

def monotone_decreasing(tokens_T, loss_T):
  """The least-squares non-increasing fit of loss over tokens (pool adjacent violators).

  Returns (tokens_P, loss_P), one point per pooled block (its mean tokens and
  mean loss), strictly decreasing in loss, so the curve can be inverted.
  """
  blocks = []  # [sum tokens, sum loss, count]
  for t, l in zip(np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)):
    blocks.append([t, l, 1])
    while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] <= blocks[-1][1] / blocks[-1][2]:
      t2, l2, c2 = blocks.pop()
      blocks[-1] = [blocks[-1][0] + t2, blocks[-1][1] + l2, blocks[-1][2] + c2]
  return (np.array([b[0] / b[2] for b in blocks]), np.array([b[1] / b[2] for b in blocks]))


@dataclasses.dataclass(frozen=True)
class BaselineCurve:
  """Tokens at which the baseline reaches a loss: its monotone fit, inverted.

  Inside the fitted range: linear interpolation between the pooled points.
  Below the baseline's last fitted loss (the recipe did better than the
  baseline ever did): extrapolated with loss = a + b ln(tokens) fitted to the
  baseline's late evaluations (`extrapolated` counts such look-ups).
  """
  tokens_P: np.ndarray
  loss_P: np.ndarray
  log_fit: tuple  # (a, b) of loss = a + b ln tokens, or None

  @classmethod
  def fit(cls, tokens_T, loss_T, late_from):
    tokens_T, loss_T = np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)
    keep = np.isfinite(loss_T) & (tokens_T > 0)
    tokens_T, loss_T = tokens_T[keep], loss_T[keep]
    tokens_P, loss_P = monotone_decreasing(tokens_T, loss_T)
    late = tokens_T >= late_from * tokens_T.max(initial=0.0)  # increasing: the last
    log_fit = None
    if late.sum() >= 2:
      b, a = np.polyfit(np.log(tokens_T[late]), loss_T[late], 1)
      log_fit = (float(a), float(b)) if b < 0 else None
    return cls(tokens_P, loss_P, log_fit)

  def tokens_for(self, loss):
    """(tokens, extrapolated?) at which the baseline reaches `loss` (nan: never
    or no evaluation after the first token)."""
    if not self.loss_P.size:
      return math.nan, False
    if loss >= self.loss_P[0]:
      return float(self.tokens_P[0]), False
    if loss >= self.loss_P[-1]:
      # np.interp needs increasing x: interpolate over the reversed curve.
      return float(np.interp(loss, self.loss_P[::-1], self.tokens_P[::-1])), False
    if self.log_fit is None:
      return math.nan, True
    a, b = self.log_fit
    return float(math.exp((loss - a) / b)), True


@dataclasses.dataclass(frozen=True)
class PowerLawCurve:
  """The baseline as L = E + A t^-alpha (least squares over its evaluations at t > 0), inverted.

  A loss at or below E is never reached (nan); below the baseline's last
  measured loss the look-up is an extrapolation of the fit.
  """
  e: float
  a: float
  alpha: float
  last_loss: float

  @classmethod
  def fit(cls, tokens_T, loss_T, late_from=None):
    del late_from  # the whole curve fixes the three parameters
    tokens_T, loss_T = np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)
    keep = np.isfinite(loss_T) & (tokens_T > 0)
    if keep.sum() < 3:
      return cls(math.nan, math.nan, math.nan, math.nan)
    t, l = tokens_T[keep] / tokens_T[keep][-1], loss_T[keep]  # t in (0, 1]: A = excess at the end

    def resid(p):
      return p[0] + np.exp(p[1]) * t ** -p[2] - l

    best = None
    for alpha0 in (0.2, 0.5, 1.0):  # a few starts: the fit is not convex
      a0 = max(l[-1] - 0.5 * l.min(), 1e-3)
      start = (l.min() - a0, math.log(a0), alpha0)
      try:
        res = optimize.least_squares(resid, start, bounds=([-np.inf, -30, 1e-4], [np.inf, 30, 5]))
      except ValueError:
        continue
      if best is None or res.cost < best.cost:
        best = res
    e, log_a, alpha = best.x
    return cls(float(e), float(math.exp(log_a)) * float(tokens_T[keep][-1]) ** float(alpha),
               float(alpha), float(l[-1]))

  def tokens_for(self, loss):
    """(tokens, extrapolated?) at which the fitted baseline reaches `loss` (nan: never)."""
    if not math.isfinite(self.e) or loss <= self.e:
      return math.nan, True
    return float(((loss - self.e) / self.a) ** (-1.0 / self.alpha)), bool(loss < self.last_loss)


@dataclasses.dataclass(frozen=True)
class Multiplier:
  """One seed's token multiplier: value, evaluations used, how many extrapolated."""
  value: float
  points: int
  extrapolated: int


def token_multiplier(tokens_T, loss_T, base_tokens_T, base_loss_T, late_from=0.5,
                     curve=None) -> Multiplier:
  """Recipe tokens / baseline tokens for the same loss, over evaluations at tokens >= late_from * last.

  The geometric mean of the per-evaluation ratios; nan when the recipe has a
  non-finite loss in that part (it diverged) or no point can be inverted
  (evaluations at 0 tokens have no ratio).
  curve: how the baseline is read, BaselineCurve (default: monotone) or
  PowerLawCurve (parametric).
  """
  tokens_T, loss_T = np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)
  base = (curve or BaselineCurve).fit(base_tokens_T, base_loss_T, late_from)
  late = tokens_T >= late_from * tokens_T[-1]
  if not np.all(np.isfinite(loss_T[late])):
    return Multiplier(math.nan, 0, 0)
  logs, extrapolated = [], 0
  for t, l in zip(tokens_T[late], loss_T[late]):
    b, extra = base.tokens_for(l)
    if t > 0 and math.isfinite(b) and b > 0:
      logs.append(math.log(t / b))
      extrapolated += extra
  if not logs:
    return Multiplier(math.nan, 0, 0)
  return Multiplier(float(math.exp(np.mean(logs))), len(logs), extrapolated)


def multiplier_interval(multipliers) -> Interval:
  """The t-interval of the per-seed multipliers (on their own scale)."""
  return t_interval([m.value for m in multipliers])


# ------------------------------------------------------------ contrasts

def late_mean(tokens_T, loss_T, late_from=0.5) -> float:
  """Mean loss over the evaluations at tokens >= late_from * the last (nan if one is non-finite)."""
  tokens_T, loss_T = np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)
  if not tokens_T.size:
    return math.nan
  return float(loss_T[tokens_T >= late_from * tokens_T[-1]].mean())


def contrast_seeds(contrast, final_loss) -> list:
  """The seeds (sorted) where every recipe of `contrast` ran; [] when one has no runs."""
  if any(r not in final_loss for r in contrast.weights):
    return []
  return sorted(set.intersection(*(set(final_loss[r]) for r in contrast.weights)))


def contrast_values(contrast, final_loss, seeds=None) -> list:
  """Per-seed values of `contrast` (its .weights {recipe: w}); final_loss: {recipe: {seed: value}}.

  On `seeds` (default: contrast_seeds, where every recipe of the contrast
  ran; a missing recipe -> []).
  """
  seeds = contrast_seeds(contrast, final_loss) if seeds is None else seeds
  return [sum(w * final_loss[r][s] for r, w in contrast.weights.items()) for s in seeds]
