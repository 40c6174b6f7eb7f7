"""Intervals, token multipliers and late means on synthetic curves with known answers."""

import math

import numpy as np
import pytest

from fp4jax.experiments import declaration
from fp4jax.experiments import stats

TOKENS = np.arange(0, 300_001, 25_000, dtype=np.float64)


def _loss(tokens):
  """A baseline-like curve: 2 + 4 (1 + t / 20k)^-0.6, strictly decreasing."""
  return 2.0 + 4.0 * (1.0 + np.asarray(tokens) / 20_000) ** -0.6


def _seeds(slowdown, n=5, noise=0.004, shift=0.0, seed=0):
  """n paired (baseline, recipe) curves; the recipe reaches each loss after
  `slowdown` times the baseline's tokens (plus `shift` nats); both carry
  independent evaluation noise of std `noise`. Each seed moves both curves by
  a shared offset (seeds differ in data and initialisation)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    offset = rng.normal(0, 0.05)
    base = _loss(TOKENS) + offset + rng.normal(0, noise, TOKENS.size)
    rec = _loss(TOKENS / slowdown) + offset + shift + rng.normal(0, noise, TOKENS.size)
    out.append((base, rec))
  return out


def _multipliers(pairs):
  return [stats.token_multiplier(TOKENS, rec, TOKENS, base) for base, rec in pairs]


def test_t_interval_matches_the_textbook_formula():
  values = [1.0, 2.0, 4.0, 3.0]
  got = stats.t_interval(values)
  half = 3.182446305284263 * np.std(values, ddof=1) / 2  # t_{0.975, 3}
  assert got.mean == pytest.approx(2.5)
  assert (got.lo, got.hi) == (pytest.approx(2.5 - half), pytest.approx(2.5 + half))
  assert got.n == 4
  one = stats.t_interval([1.5, math.nan])
  assert one.n == 1 and math.isnan(one.lo)


def test_monotone_fit_pools_violators():
  tokens, loss = stats.monotone_decreasing([1, 2, 3, 4], [5.0, 3.0, 4.0, 1.0])
  np.testing.assert_allclose(tokens, [1, 2.5, 4])
  np.testing.assert_allclose(loss, [5.0, 3.5, 1.0])


def test_exact_slowdown_gives_its_multiplier():
  base = _loss(TOKENS)
  m = stats.token_multiplier(TOKENS, _loss(TOKENS / 1.10), TOKENS, base)
  assert m.value == pytest.approx(1.10, rel=5e-3)
  assert m.points == 7 and m.extrapolated == 0
  # A recipe better than the baseline needs the baseline's extrapolated curve.
  better = stats.token_multiplier(TOKENS, _loss(TOKENS / 0.9), TOKENS, base)
  assert better.extrapolated > 0 and better.value == pytest.approx(0.9, rel=0.03)


def test_ten_percent_slower_recipe_interval_holds_1_10_not_1():
  interval = stats.multiplier_interval(_multipliers(_seeds(1.10)))
  assert interval.contains(1.10), interval
  assert not interval.contains(1.0), interval
  assert interval.hi - interval.lo < 0.1


def test_recipe_equal_to_baseline_holds_1():
  pairs = _seeds(1.0, seed=1)
  interval = stats.multiplier_interval(_multipliers(pairs))
  assert interval.contains(1.0), interval


def test_clearly_worse_recipe_has_a_multiplier_well_above_1():
  worse = _seeds(1.5, seed=2)
  assert stats.t_interval([r[-1] - b[-1] for b, r in worse]).lo > 0
  assert stats.multiplier_interval(_multipliers(worse)).lo > 1.3


def test_diverged_recipe_has_no_multiplier():
  rec = _loss(TOKENS)
  rec[-2] = math.nan
  assert math.isnan(stats.token_multiplier(TOKENS, rec, TOKENS, _loss(TOKENS)).value)


def test_contrast_uses_only_seeds_every_recipe_ran():
  final = {"a": {0: 1.0, 1: 2.0, 2: 3.0}, "b": {1: 1.5, 2: 2.0}}
  values = stats.contrast_values(declaration.Contrast("a - b", {"a": 1, "b": -1}, ">"), final)
  assert values == [0.5, 1.0]


def test_power_law_baseline_gives_the_exact_multiplier():
  """On L = E + A t^-alpha the fitted baseline is exact, so a 10% slower recipe reads 1.10."""
  base = 1.5 + 30.0 * TOKENS[1:] ** -0.4
  slower = 1.5 + 30.0 * (TOKENS[1:] / 1.10) ** -0.4
  curve = stats.PowerLawCurve.fit(TOKENS[1:], base)
  assert (curve.e, curve.a, curve.alpha) == (pytest.approx(1.5, abs=1e-4), pytest.approx(30, rel=1e-3),
                                             pytest.approx(0.4, rel=1e-4))
  m = stats.token_multiplier(TOKENS[1:], slower, TOKENS[1:], base, curve=stats.PowerLawCurve)
  assert m.value == pytest.approx(1.10, rel=1e-5) and m.extrapolated == 0
  better = stats.token_multiplier(TOKENS[1:], 1.5 + 30.0 * (TOKENS[1:] / 0.9) ** -0.4,
                                  TOKENS[1:], base, curve=stats.PowerLawCurve)
  assert better.value == pytest.approx(0.9, rel=1e-4) and better.extrapolated > 0
  assert math.isnan(curve.tokens_for(1.4)[0])  # below the asymptote: never reached


def test_late_mean_averages_the_second_half():
  tokens = np.array([0.0, 100, 200, 300, 400])
  assert stats.late_mean(tokens, [9.0, 8, 3, 2, 1]) == pytest.approx(2.0)  # 200, 300, 400
  assert math.isnan(stats.late_mean(tokens, [9.0, 8, 3, math.nan, 1]))


def test_a_curve_of_one_evaluation_has_no_multiplier_and_no_error():
  """A run with one evaluation (at 0 tokens, or the baseline's only one) has
  no token ratio: nan, not a math domain error."""
  one, zero = np.array([0.0]), np.array([6.0])
  assert math.isnan(stats.token_multiplier(one, zero, TOKENS, _loss(TOKENS)).value)
  assert math.isnan(stats.token_multiplier(TOKENS, _loss(TOKENS), one, zero).value)
  for curve in (stats.BaselineCurve, stats.PowerLawCurve):
    assert math.isnan(curve.fit(one, zero, 0.5).tokens_for(5.0)[0])
