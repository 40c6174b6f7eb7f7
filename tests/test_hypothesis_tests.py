"""Holm, sign flips, power, declarations and verdicts on cases with known answers."""

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fp4jax import errors
from fp4jax.experiments import declaration
from fp4jax.experiments import hypothesis_tests
from fp4jax.experiments import verdicts


def test_holm_adjusts_by_rank_and_keeps_order():
  # sorted: 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 = 0.04 -> max so far 0.06
  assert hypothesis_tests.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
  got = hypothesis_tests.holm([0.5, math.nan, 0.2])  # nan is not a hypothesis: m = 2
  assert got[0] == pytest.approx(0.5) and math.isnan(got[1]) and got[2] == pytest.approx(0.4)


def test_holm_levels_agree_with_holm_decisions():
  # 0.005 <= 0.05/4 and 0.01 <= 0.05/3 are rejected; 0.03 > 0.05/2 stops: the rest at 0.975.
  levels = hypothesis_tests.holm_levels([0.01, 0.04, 0.03, 0.005])
  assert levels == pytest.approx([1 - 0.05 / 3, 0.975, 0.975, 1 - 0.05 / 4])
  rng = np.random.default_rng(0)
  for _ in range(200):  # a t-interval at its Holm level excludes 0 iff Holm rejects
    samples = [rng.normal(rng.choice([0.0, 1.0]), 1.0, 6) for _ in range(5)]
    p = [hypothesis_tests.t_p_value(s) for s in samples]
    for s, adj, level in zip(samples, hypothesis_tests.holm(p), hypothesis_tests.holm_levels(p)):
      half = scipy_stats.t.ppf(0.5 + level / 2, 5) * s.std(ddof=1) / math.sqrt(6)
      assert (abs(s.mean()) > half) == (adj <= 0.05)


def test_sign_flip_p_counts_patterns():
  assert hypothesis_tests.sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 32)  # the floor
  # sums of +-3 +-1 +-2: 6 4 2 0 0 -2 -4 -6; |sum| >= 4 in 4 of 8
  assert hypothesis_tests.sign_flip_p([3.0, -1.0, 2.0]) == pytest.approx(0.5)
  assert hypothesis_tests.sign_flip_p([1.0, -1.0]) == 1.0
  with pytest.raises(ValueError, match="2\\^n"):
    hypothesis_tests.sign_flip_p(np.ones(41))


def test_sign_flip_p_is_the_count_over_every_pattern():
  rng = np.random.default_rng(3)
  for n in (1, 2, 5, 9, 14):  # against all 2^n patterns, written out
    v = rng.normal(0.3, 1.0, n)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    want = np.mean(np.abs(signs @ v) >= abs(v.sum()) * (1 - 1e-12))
    assert hypothesis_tests.sign_flip_p(v) == pytest.approx(want, abs=1e-15)
  # 25 seeds (E5's): powers of two give 2^25 distinct sums; only the observed
  # pattern and its mirror reach |sum|, and 25 equal values likewise
  assert hypothesis_tests.sign_flip_p(2.0 ** np.arange(25)) == 2 / 2 ** 25
  assert hypothesis_tests.sign_flip_p(np.ones(25)) == 2 / 2 ** 25
  # +-1 in equal numbers: every pattern's |sum| >= 0
  assert hypothesis_tests.sign_flip_p([1.0, -1.0] * 12) == 1.0


def test_t_p_value_matches_scipy():
  v = [0.3, -0.1, 0.5, 0.2, 0.4]
  assert hypothesis_tests.t_p_value(v) == pytest.approx(scipy_stats.ttest_1samp(v, 0.0).pvalue)


def test_mde_has_its_power_in_a_simulation():
  n, sd, alpha = 5, 1.0, 0.05
  d = hypothesis_tests.mde(sd, n, alpha)
  # The normal-quantile shortcut (z_{1-a/2} + z_{0.8}) sd / sqrt(n) = 1.25 is too optimistic at n = 5.
  assert d > 1.3
  rng = np.random.default_rng(1)
  x = rng.normal(d, sd, (40_000, n))
  t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
  hit = np.mean(np.abs(t) > scipy_stats.t.ppf(1 - alpha / 2, n - 1))
  assert hit == pytest.approx(0.8, abs=0.01)  # SE of the share: 0.002
  assert hypothesis_tests.mde(2 * sd, n, alpha) == pytest.approx(2 * d)
  assert math.isnan(hypothesis_tests.mde(sd, 1)) and math.isnan(hypothesis_tests.mde(0.0, 5))


def test_smallest_effect_through_the_log_slope():
  tokens = np.arange(0, 7) * 50_000.0
  loss = 5.0 - 0.33 * np.log(np.maximum(tokens, 1.0))
  loss[1] += 1.0  # early points do not count (late_from 0.5: tokens >= 150k)
  assert hypothesis_tests.log_slope(tokens, loss) == pytest.approx(-0.33)
  assert hypothesis_tests.effect_nats(-0.33, 0.05) == pytest.approx(0.33 * math.log(1.05))


@pytest.mark.parametrize("lo,hi,direction,want", [
    (0.001, 0.03, ">", "supported"), (-0.02, 0.015, ">", "contradicted"),
    (-0.02, 0.017, ">", "inconclusive"), (-0.03, -0.001, "<", "supported"),
    (-0.015, 0.02, "<", "contradicted"), (-0.03, -0.001, "!=", "supported"),
    (-0.015, 0.015, "!=", "contradicted"), (-0.02, 0.01, "!=", "inconclusive"),
    (math.nan, math.nan, ">", "inconclusive")])
def test_decide(lo, hi, direction, want):
  assert hypothesis_tests.decide(lo, hi, direction, smallest=0.016) == want


def _declaration(tmp_path, claims, **over):
  raw = {"study": "t", "baseline": "base", "primary": "late_mean", "late_from": 0.5,
         "smallest_effect_tokens": 0.05, "alpha": 0.05, "correction": "holm", "power": 0.8,
         "claims": claims, **over}
  path = tmp_path / "DECLARATION.json"
  path.write_text(json.dumps(raw))
  return path


def _claim(text, weights, direction=">"):
  return {"text": text, "contrasts": [{"label": text, "weights": weights,
                                       "direction": direction}]}


def test_declaration_hash_is_recorded_once_and_checked(tmp_path):
  path = _declaration(tmp_path, [_claim("a", {"a": 1, "base": -1})])
  work = tmp_path / "work"
  assert declaration.status(work, path) == "undeclared"
  rec = declaration.record(work, path)
  assert rec["sha256"] == declaration.file_hash(path)
  assert declaration.status(work, path) == "declared"
  path.write_text(path.read_text().replace('"power": 0.8', '"power": 0.9'))
  assert declaration.status(work, path) == "changed"
  assert declaration.record(work, path) == rec  # the first record stays
  assert declaration.status(work, path) == "changed"


def test_bad_declaration_is_a_user_error(tmp_path):
  with pytest.raises(errors.UserError, match="direction '>=' is not one of"):
    declaration.load(_declaration(tmp_path, [_claim("a", {"a": 1}, ">=")]))
  with pytest.raises(errors.UserError, match="primary 'best'"):
    declaration.load(_declaration(tmp_path, [_claim("a", {"a": 1})], primary="best"))
  path = _declaration(tmp_path, [_claim("a", {"a": 1})])
  raw = json.loads(path.read_text())
  del raw["power"]
  path.write_text(json.dumps(raw))
  with pytest.raises(errors.UserError, match="field .power. is missing"):
    declaration.load(path)


def test_verdicts_follow_holm_and_the_smallest_effect(tmp_path):
  """Per-seed primary values built so that: `big` is clearly worse than base;
  `same` equals it to within 0.002 (an effect of 0.016 is ruled out); `edge`
  is worse with an unadjusted p just under 0.05, which Holm over 4 claims
  does not reject; `gone` never ran."""
  seeds = range(6)
  noise = np.array([0.001, -0.002, 0.0015, -0.001, 0.0005, 0.0])
  primary = {"base": {s: 2.0 for s in seeds},
             "big": {s: 2.05 + noise[s] for s in seeds},
             "same": {s: 2.0 + noise[s] for s in seeds},
             "edge": {s: 2.0 + v for s, v in zip(seeds, [0.02, 0.004, 0.024, 0.004, 0.018, 0.002])}}
  decl = declaration.load(_declaration(tmp_path, [
      _claim("big hurts", {"big": 1, "base": -1}), _claim("same hurts", {"same": 1, "base": -1}),
      _claim("edge hurts", {"edge": 1, "base": -1}), _claim("gone hurts", {"gone": 1, "base": -1})]))
  edge_p = hypothesis_tests.t_p_value([primary["edge"][s] - 2.0 for s in seeds])
  assert 0.025 < edge_p < 0.05  # rank 2 of 3: Holm multiplies by 2
  results = verdicts.evaluate(decl, primary, smallest=0.016)
  assert [r.verdict for r in results] == ["supported", "contradicted", "inconclusive", "not run"]
  assert results[2].p_holm == pytest.approx(2 * edge_p)  # ranks: big, edge, same (3 claims ran)
  assert results[0].contrasts[0].interval.lo > 0
  text = verdicts.lines(results, 0.016)
  assert text[0].startswith("- **supported**: big hurts") and "sign-flip p = 0.031" in text[0]
  assert "could have seen" in text[1] and text[3].startswith("- **not run**")
