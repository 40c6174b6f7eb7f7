"""Tokens-to-target on synthetic validation curves."""

import math

import pytest

from fp4jax.experiments.tokens_to_target import overhead, tokens_to_target


def test_interpolates_between_evaluations():
  out = tokens_to_target([100, 200, 300, 400], [5.0, 4.0, 3.0, 2.5], 3.5)
  assert out.status == "reached"
  assert out.tokens == pytest.approx(250.0)


def test_first_crossing_counts_not_a_later_one():
  out = tokens_to_target([10, 20, 30, 40], [4.0, 2.0, 4.0, 1.0], 3.0)
  assert out.tokens == pytest.approx(15.0)


def test_reached_at_first_evaluation():
  assert tokens_to_target([10, 20], [1.0, 0.5], 2.0).tokens == 10.0


def test_exactly_on_target():
  assert tokens_to_target([10, 20, 30], [3.0, 2.0, 1.0], 2.0).tokens == 20.0


def test_never_reached():
  out = tokens_to_target([1, 2, 3], [5.0, 4.5, 4.2], 4.0)
  assert out.tokens is None and not out.diverged
  assert out.status == "not reached"


def test_nan_is_diverged_and_later_points_ignored():
  out = tokens_to_target([1, 2, 3, 4], [5.0, 4.5, math.nan, 1.0], 2.0)
  assert out.diverged and out.tokens is None
  assert out.status == "diverged"


def test_reached_then_nan_keeps_tokens_but_is_diverged():
  out = tokens_to_target([1, 2, 3], [5.0, 3.0, math.inf], 4.0)
  assert out.diverged and out.tokens == pytest.approx(1.5)


def test_ending_above_bound_is_diverged():
  out = tokens_to_target([1, 2, 3], [5.0, 3.0, 6.0], 4.0, diverge_above=5.5)
  assert out.diverged
  assert not tokens_to_target([1, 2, 3], [5.0, 3.0, 5.0], 4.0,
                              diverge_above=5.5).diverged


def test_bad_input_rejected():
  with pytest.raises(ValueError, match="increasing"):
    tokens_to_target([2, 1], [1.0, 1.0], 1.0)
  with pytest.raises(ValueError, match="equal length"):
    tokens_to_target([1, 2], [1.0], 1.0)


def test_overhead():
  assert overhead(127.0, 100.0) == pytest.approx(0.27)
  assert overhead(None, 100.0) is None
  assert overhead(100.0, None) is None
