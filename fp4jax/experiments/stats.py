"""Paired estimates with confidence intervals, and the verdicts on the paper's claims.

Every recipe of a seed sees the same initialisation and data order, so each
recipe is compared with the baseline (or another recipe) of the same seed and
the intervals are over seeds: a 95% Student t-interval of the per-seed values
(`t_interval`; n - 1 degrees of freedom, no interval with one seed).

Two per-seed estimates:
  final-loss difference  the recipe's final validation loss minus the other's;
  token multiplier       how many times the tokens the baseline needs to reach
                         the loss the recipe reaches (`token_multiplier`):
                         for each of the recipe's evaluations in the late part
                         of training, the tokens at which the baseline's
                         monotone-smoothed curve reaches that loss, the ratio
                         of the two token counts, and the geometric mean of the
                         ratios. 1.10 = the recipe needs 10% more tokens.
Claims (`CLAIMS`) are linear contrasts of per-seed final losses, e.g. the
Wgrad increment minus the Dgrad increment; `verdict` reads their intervals.
"""

import dataclasses
import math

import numpy as np
from scipy import stats as scipy_stats

from fp4jax import diagnostics

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
    late = tokens_T >= late_from * tokens_T[-1]
    log_fit = None
    if late.sum() >= 2:
      b, a = np.polyfit(np.log(tokens_T[late]), loss_T[late], 1)
      log_fit = (float(a), float(b)) if b < 0 else None
    return cls(tokens_P, loss_P, log_fit)

  def tokens_for(self, loss):
    """(tokens, extrapolated?) at which the baseline reaches `loss` (nan: never)."""
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
class Multiplier:
  """One seed's token multiplier: value, evaluations used, how many extrapolated."""
  value: float
  points: int
  extrapolated: int


def token_multiplier(tokens_T, loss_T, base_tokens_T, base_loss_T, late_from=0.5) -> Multiplier:
  """Recipe tokens / baseline tokens for the same loss, over evaluations at tokens >= late_from * last.

  The geometric mean of the per-evaluation ratios; nan when the recipe has a
  non-finite loss in that part (it diverged) or no point can be inverted.
  """
  tokens_T, loss_T = np.asarray(tokens_T, np.float64), np.asarray(loss_T, np.float64)
  base = BaselineCurve.fit(base_tokens_T, base_loss_T, late_from)
  late = tokens_T >= late_from * tokens_T[-1]
  if not np.all(np.isfinite(loss_T[late])):
    return Multiplier(math.nan, 0, 0)
  logs, extrapolated = [], 0
  for t, l in zip(tokens_T[late], loss_T[late]):
    b, extra = base.tokens_for(l)
    if math.isfinite(b) and b > 0:
      logs.append(math.log(t / b))
      extrapolated += extra
  if not logs:
    return Multiplier(math.nan, 0, 0)
  return Multiplier(float(math.exp(np.mean(logs))), len(logs), extrapolated)


def multiplier_interval(multipliers) -> Interval:
  """The t-interval of the per-seed multipliers (on their own scale)."""
  return t_interval([m.value for m in multipliers])


# ------------------------------------------------------------ claims and verdicts

@dataclasses.dataclass(frozen=True)
class Contrast:
  """sum_r weight_r * final_loss_r over recipes, per seed; `claim` is "> 0" or "!= 0"."""
  label: str
  weights: dict
  claim: str = "> 0"


@dataclasses.dataclass(frozen=True)
class Claim:
  """A claim of the paper; it holds when every contrast holds."""
  text: str
  contrasts: tuple


CLAIMS = (
    Claim("Wgrad is the costly stage (its increment exceeds Fprop's and Dgrad's)", (
        Contrast("(mxfp4 - fprop-dgrad) - (fprop-dgrad - fprop)",
                 {"mxfp4": 1, "mxfp4-fprop-dgrad": -2, "mxfp4-fprop": 1}),
        Contrast("(mxfp4 - fprop-dgrad) - (fprop - fp8)",
                 {"mxfp4": 1, "mxfp4-fprop-dgrad": -1, "mxfp4-fprop": -1, "fp8": 1}))),
    Claim("Stochastic rounding hurts once Wgrad is MXFP4", (
        Contrast("mxfp4-sr - mxfp4", {"mxfp4-sr": 1, "mxfp4": -1}),)),
    Claim("Random-sign Hadamard hurts (vs no rotation)", (
        Contrast("mxfp4-rh16 - mxfp4", {"mxfp4-rh16": 1, "mxfp4": -1}),)),
    Claim("Random signs are worse than the deterministic H16", (
        Contrast("mxfp4-rh16 - mxfp4-dh16", {"mxfp4-rh16": 1, "mxfp4-dh16": -1}),)),
    Claim("Deterministic H16 recovers most (> half) of the MXFP4 gap to fp8", (
        Contrast("(mxfp4 - dh16) - 0.5 (mxfp4 - fp8)",
                 {"mxfp4": 0.5, "mxfp4-dh16": -1, "fp8": 0.5}),)),
    Claim("The scale rule matters without rotation (floor vs even)", (
        Contrast("mxfp4-floor - mxfp4", {"mxfp4-floor": 1, "mxfp4": -1}, "!= 0"),)),
    Claim("The scale rule matters with H16 (floor vs even)", (
        Contrast("mxfp4-dh16-floor - mxfp4-dh16", {"mxfp4-dh16-floor": 1, "mxfp4-dh16": -1},
                 "!= 0"),)),
)


def contrast_values(contrast, final_loss) -> list:
  """Per-seed values of `contrast`; final_loss: {recipe: {seed: loss}}.

  Only seeds where every recipe of the contrast ran; a missing recipe -> [].
  """
  if any(r not in final_loss for r in contrast.weights):
    return []
  seeds = set.intersection(*(set(final_loss[r]) for r in contrast.weights))
  return [sum(w * final_loss[r][s] for r, w in contrast.weights.items()) for s in sorted(seeds)]


def contrast_verdict(interval, claim="> 0", margin=0.01) -> str:
  """supported / contradicted / inconclusive for one contrast's interval.

  "> 0": supported when the interval lies above 0; contradicted when it lies
  below `margin` (it rules out an effect of the claimed sign as large as the
  margin). "!= 0": supported when it excludes 0; contradicted when it lies
  inside (-margin, margin). Anything else, or fewer than 2 seeds: inconclusive.
  """
  if interval.n < 2:
    return "inconclusive"
  if claim == "> 0":
    if interval.lo > 0:
      return "supported"
    return "contradicted" if interval.hi < margin else "inconclusive"
  if claim == "!= 0":
    if interval.lo > 0 or interval.hi < 0:
      return "supported"
    return "contradicted" if -margin < interval.lo and interval.hi < margin else "inconclusive"
  raise ValueError(f"unknown claim {claim!r}; allowed: '> 0', '!= 0'")


def claim_verdict(verdicts) -> str:
  """A claim of several contrasts: supported if all are, contradicted if any is."""
  if verdicts and all(v == "supported" for v in verdicts):
    return "supported"
  return "contradicted" if "contradicted" in verdicts else "inconclusive"


def verdict_lines(final_loss, margin=0.01, claims=CLAIMS) -> list[str]:
  """One markdown line per claim: verdict, then each contrast's interval (nats)."""
  lines = []
  for claim in claims:
    parts, verdicts = [], []
    for c in claim.contrasts:
      values = contrast_values(c, final_loss)
      if not values:
        parts.append(f"{c.label}: not run")
        verdicts.append("not run")
        continue
      interval = t_interval(values)
      v = contrast_verdict(interval, c.claim, margin)
      verdicts.append(v)
      lost = sum(not math.isfinite(x) for x in values)
      note = f", {lost} seed(s) with a non-finite loss left out" if lost else ""
      parts.append(f"{c.label} = {interval} nats (n={interval.n}{note}; claim {c.claim}: {v})")
    verdict = "not run" if "not run" in verdicts else claim_verdict(verdicts)
    lines.append(f"- **{verdict}**: {claim.text}. " + "; ".join(parts) + ".")
  return lines


# ------------------------------------------------------------ gradient signal-to-noise

@dataclasses.dataclass(frozen=True)
class Crossing:
  """Where a signal-to-noise series reaches the threshold.

  step: the first step at or below it, interpolated in ln(snr) between the
  two measurements around it (measured), or where the log-linear trend
  ln snr = a + slope * step fitted to the later measurements reaches it
  (extrapolated = True); None when neither (the trend does not fall).
  """
  step: float | None
  extrapolated: bool
  slope: float


def threshold_crossing(steps, snr, threshold=diagnostics.SNR_THRESHOLD, fit_from=0.5) -> Crossing:
  """The Crossing of the series (steps increasing, snr > 0) with `threshold`.

  The trend is fitted to the measurements at steps >= fit_from * last step
  (all of them when fewer than two steps are that late).
  """
  steps, snr = np.asarray(steps, np.float64), np.asarray(snr, np.float64)
  keep = np.isfinite(snr) & (snr > 0)
  steps, log_snr = steps[keep], np.log(snr[keep])
  if steps.size < 2:
    return Crossing(None, False, math.nan)
  late = steps >= fit_from * steps[-1]
  if np.unique(steps[late]).size < 2:
    late = np.ones_like(late)
  slope, intercept = np.polyfit(steps[late], log_snr[late], 1)
  log_thr = math.log(threshold)
  below = np.nonzero(log_snr <= log_thr)[0]
  if below.size:
    i = int(below[0])
    if i == 0:
      return Crossing(float(steps[0]), False, float(slope))
    s0, s1, l0, l1 = steps[i - 1], steps[i], log_snr[i - 1], log_snr[i]
    return Crossing(float(s0 + (l0 - log_thr) / (l0 - l1) * (s1 - s0)), False, float(slope))
  if slope >= 0:
    return Crossing(None, True, float(slope))
  return Crossing(float((log_thr - intercept) / slope), True, float(slope))
