"""Tokens to reach a target validation loss, read off a validation curve.

A curve is the list of evaluations of one run: tokens consumed (increasing) and
the validation loss there. The tokens at which the target is first reached are
interpolated linearly between the two evaluations around the crossing. Over
seeds, `median_with_misses` is the median with a seed that never reached the
target counted as never (+infinity).
"""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one run did against the target.

  tokens: tokens at which the loss first reached the target (None: not reached).
  diverged: the loss became NaN/Inf, or the final loss is above the bound.
  """
  tokens: float | None
  diverged: bool

  @property
  def status(self) -> str:
    if self.diverged:
      return "diverged"
    return "not reached" if self.tokens is None else "reached"


def tokens_to_target(tokens_T, loss_T, target, diverge_above=None) -> Outcome:
  """Returns the Outcome of a validation curve (tokens_T, loss_T) for `target`.

  Evaluations after the first non-finite loss are ignored; a non-finite loss,
  or a last finite loss above `diverge_above`, marks the run diverged.
  """
  tokens_T = np.asarray(tokens_T, np.float64)
  loss_T = np.asarray(loss_T, np.float64)
  if tokens_T.shape != loss_T.shape or tokens_T.ndim != 1:
    raise ValueError(
        f"tokens and loss must be 1-D of equal length, got {tokens_T.shape} "
        f"and {loss_T.shape}")
  if np.any(np.diff(tokens_T) <= 0):
    raise ValueError("tokens must be strictly increasing")
  bad = ~np.isfinite(loss_T)
  n_good = int(np.argmax(bad)) if bad.any() else len(loss_T)
  tokens_T, loss_T = tokens_T[:n_good], loss_T[:n_good]
  diverged = bool(bad.any()) or n_good == 0 or (
      diverge_above is not None and loss_T[-1] > diverge_above)
  hit = np.nonzero(loss_T <= target)[0]
  if hit.size == 0:
    return Outcome(None, diverged)
  i = int(hit[0])
  if i == 0:
    return Outcome(float(tokens_T[0]), diverged)
  t0, t1, l0, l1 = tokens_T[i - 1], tokens_T[i], loss_T[i - 1], loss_T[i]
  return Outcome(float(t0 + (l0 - target) / (l0 - l1) * (t1 - t0)), diverged)


def overhead(tokens, baseline_tokens) -> float | None:
  """Extra tokens relative to the baseline: tokens / baseline - 1 (None if
  unknown, or the baseline was at the target before its first token)."""
  if tokens is None or baseline_tokens is None or not math.isfinite(tokens) or (
      baseline_tokens <= 0):
    return None
  return tokens / baseline_tokens - 1.0


def median_with_misses(values) -> float | None:
  """The median over seeds of `values`, a seed that never reached the target
  (None) counted as +infinity; None when no seed ran or half or more did
  not reach it (the median would then be infinite or straddle infinity)."""
  values = list(values)
  misses = sum(v is None for v in values)
  if not values or 2 * misses >= len(values):
    return None
  return float(np.median([math.inf if v is None else float(v) for v in values]))
