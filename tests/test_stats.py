"""Intervals, token multipliers and verdicts on synthetic curves with known answers."""

import math

import numpy as np
import pytest

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


def test_recipe_equal_to_baseline_holds_1_and_is_inconclusive():
  pairs = _seeds(1.0, seed=1)
  interval = stats.multiplier_interval(_multipliers(pairs))
  assert interval.contains(1.0), interval
  # A tiny margin: equality is not proven, so the claim "it hurts" is open.
  diff = stats.t_interval([r[-1] - b[-1] for b, r in pairs])
  assert stats.contrast_verdict(diff, "> 0", margin=0.0) == "inconclusive"
  assert stats.contrast_verdict(diff, "!= 0", margin=0.0) == "inconclusive"
  # With the default margin (0.01 nats) an effect that large is ruled out.
  assert stats.contrast_verdict(diff, "> 0") == "contradicted"
  assert stats.contrast_verdict(diff, "!= 0") == "contradicted"


def test_clearly_worse_recipe_is_supported_and_better_one_contradicted():
  worse = _seeds(1.5, seed=2)
  diff = stats.t_interval([r[-1] - b[-1] for b, r in worse])
  assert diff.lo > 0
  assert stats.contrast_verdict(diff, "> 0") == "supported"
  assert stats.contrast_verdict(diff, "!= 0") == "supported"
  assert stats.multiplier_interval(_multipliers(worse)).lo > 1.3
  better = stats.t_interval([b[-1] - r[-1] for b, r in worse])
  assert stats.contrast_verdict(better, "> 0") == "contradicted"


def test_diverged_recipe_has_no_multiplier():
  rec = _loss(TOKENS)
  rec[-2] = math.nan
  assert math.isnan(stats.token_multiplier(TOKENS, rec, TOKENS, _loss(TOKENS)).value)


def _final(curves):
  """{recipe: {seed: final loss}} from {recipe: [curve per seed]}."""
  return {r: {s: float(c[-1]) for s, c in enumerate(cs)} for r, cs in curves.items()}


def test_verdict_lines_on_a_synthetic_ablation():
  """Built so that: Wgrad's increment (0.06) dwarfs Fprop's and Dgrad's
  (0.01 each); SR adds nothing; random signs add 0.03; dh16 recovers 0.06 of
  the 0.08 gap; floor equals even without rotation (the scale-rule claim
  there is contradicted) and costs 0.02 with H16; dh32 did not run."""
  rng = np.random.default_rng(3)
  shift = {"fp8": 0.0, "mxfp4-fprop": 0.01, "mxfp4-fprop-dgrad": 0.02, "mxfp4": 0.08,
           "mxfp4-sr": 0.08, "mxfp4-rh16": 0.11, "mxfp4-dh16": 0.02, "mxfp4-floor": 0.08,
           "mxfp4-dh16-floor": 0.04}
  offsets = rng.normal(0, 0.05, 6)
  curves = {r: [_loss(TOKENS) + o + d + rng.normal(0, 0.002, TOKENS.size) for o in offsets]
            for r, d in shift.items()}
  lines = stats.verdict_lines(_final(curves))
  assert len(lines) == len(stats.CLAIMS)
  verdicts = [line.split("**")[1] for line in lines]
  assert verdicts == ["supported", "contradicted", "supported", "supported", "supported",
                      "contradicted", "supported"], lines
  assert "[+" in lines[0] and "n=6" in lines[0]
  del curves["mxfp4-sr"]
  assert stats.verdict_lines(_final(curves))[1].startswith("- **not run**")


def test_contrast_uses_only_seeds_every_recipe_ran():
  final = {"a": {0: 1.0, 1: 2.0, 2: 3.0}, "b": {1: 1.5, 2: 2.0}}
  values = stats.contrast_values(stats.Contrast("a - b", {"a": 1, "b": -1}), final)
  assert values == [0.5, 1.0]
  with pytest.raises(ValueError, match="unknown claim"):
    stats.contrast_verdict(stats.t_interval(values), "< 0")


def test_verdict_reads_the_interval_not_the_mean():
  straddles = stats.Interval(0.01, -0.005, 0.025, 5)
  assert stats.contrast_verdict(straddles, "> 0") == "inconclusive"
  assert stats.contrast_verdict(straddles, "!= 0") == "inconclusive"
  below = stats.Interval(-0.01, -0.025, 0.005, 5)
  assert stats.contrast_verdict(below, "!= 0") == "inconclusive"  # reaches beyond -margin
  assert stats.contrast_verdict(below, "> 0") == "contradicted"
  assert stats.contrast_verdict(stats.Interval(0.05, 0.04, 0.06, 1), "> 0") == "inconclusive"


def test_snr_crossing_measured_and_extrapolated():
  steps = np.arange(0, 301, 50)
  falling = 8.0 * np.exp(-steps / 100)  # reaches sqrt(3) at 100 ln(8 / sqrt 3) = 153
  got = stats.threshold_crossing(steps, falling)
  want = 100 * math.log(8 / math.sqrt(3))
  assert not got.extrapolated and got.step == pytest.approx(want, rel=1e-6)
  slow = 8.0 * np.exp(-steps / 1000)  # within the run it stays above: extrapolate
  got = stats.threshold_crossing(steps, slow)
  assert got.extrapolated and got.step == pytest.approx(1000 * math.log(8 / math.sqrt(3)))
  assert got.slope == pytest.approx(-1e-3)
  flat = stats.threshold_crossing(steps, 5.0 + 0.01 * steps)
  assert flat.step is None and flat.slope > 0
