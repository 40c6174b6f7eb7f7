"""Stochastic rounding verified as a distribution, for every element format
and scale rule: each result is one of the two grid neighbours of its input,
the magnitude rounds up as often as its fraction says (a binomial test), and
the mean of many draws is the input. The same for the biased and few-bit SRs
(QuantSpec.sr_round_up_scale, sr_bits), with their own round-up probabilities.

Declared level: each test case fails when any of its values has a two-sided
binomial p-value below ALPHA / (number of values) (Bonferroni), so a correct
SR fails a case with probability below ALPHA. The keys are fixed, so a run
is reproducible.

Inputs: in the element domain, every interval between adjacent grid values
from -max to max (subnormals and the top binade included) at fractions
FRACTIONS, plus the grid values themselves; each block holds one anchor that
sets a power-of-two scale (so x = w * scale is exact), and under the floor
rule a block whose anchor lies above the element max (saturation).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import formats
from tests import numpy_reference as ref
from tests.helpers import binomial_two_sided_p

N_DRAWS = 4096
ALPHA = 1e-6
FRACTIONS = (0.001, 1 / 3, 0.5, 0.9)


def _element_values(elem):
  """float32 test values in [-max, max]: every grid value and, in every gap
  between neighbours, one value per fraction."""
  grid = ref.element_grid(elem)
  full = np.concatenate([-grid[:0:-1], grid])
  inner = [np.float32(lo + f * (hi - lo)) for lo, hi in zip(full[:-1], full[1:])
           for f in FRACTIONS]
  return np.unique(np.concatenate([full.astype(np.float32), inner]))


def _blocks(spec, saturate=False):
  """(x [B, block] float32, scale [B, 1] float64, tested [B, block] bool).

  Block b: element 0 an anchor, max * 2^e_b with e_b = b mod 5 - 2, the rest
  the test values times 2^e_b; scale: the reference's block scale (asserted
  a power of two, so every scaled value is exact); tested: the elements
  within the anchor's scaled value (a rule that picks a larger scale, ceil,
  reaches less of the grid). NVFP4: block 0 holds 2688 alone (global scale
  1) and is not tested. FP8 per tensor: one row, scale 1. saturate: anchors
  above the element max (floor rule), so they saturate.
  """
  elem = spec.element.name
  vmax = spec.element_max
  w = _element_values(elem)
  block = spec.block or (len(w) + 1)
  per = block - 1
  n_blocks = -(-len(w) // per)
  if spec.family == "nvfp4":
    n_blocks += 1  # block 0 holds the global amax 2688: global scale 1
  top = 2.0**(np.floor(np.log2(vmax)) + 1)  # the next binade: above max
  anchor = (vmax + top) / 2 if saturate else vmax
  x = np.zeros((n_blocks, block), np.float32)
  tested = np.zeros_like(x, bool)
  first = 0
  if spec.family == "nvfp4":
    x[0, 0] = formats.NVFP4_GLOBAL_DIVISOR
    first = 1
  exps = np.zeros((n_blocks, 1))
  for b in range(first, n_blocks):
    exps[b] = 0 if spec.family == "fp8" else (b % 5) - 2
    chunk = w[(b - first) * per:(b - first + 1) * per]
    x[b, 0] = anchor * 2.0**exps[b, 0]
    x[b, 1:1 + len(chunk)] = chunk * 2.0**exps[b, 0]
    tested[b, 1:1 + len(chunk)] = True
  got = ref.quantize(x, spec.fmt, None, spec.scale_mode, "nearest", -1)
  if spec.family == "mx":
    scale = np.ldexp(1.0, got["scale"]).reshape(-1, 1)
  else:
    scale = np.asarray(got["scale"], np.float64).reshape(-1, 1) * (got["global_scale"] or 1.0)
  if spec.family == "nvfp4":
    tested[0] = False
  # The scale rule may pick a larger scale (ceil): test only what fits.
  reach = np.abs(x[:, :1]) / scale
  tested &= np.abs(x) / scale <= reach
  assert np.all(np.log2(scale[first:]) % 1 == 0), "test setup: scales are powers of two"
  tested[first:, 0] = True  # the anchor itself
  return x, scale, tested


def _magnitude_neighbours(v, vmax, grid):
  """(lo, hi, p): the grid magnitudes around |v| and |v|'s fraction between
  them; beyond vmax both are vmax and p = 0."""
  a = np.abs(v)
  hi_i = np.clip(np.searchsorted(grid, a, side="right"), 1, len(grid) - 1)
  lo, hi = grid[hi_i - 1], grid[hi_i]
  p = (a - lo) / (hi - lo)
  sat = a >= vmax
  return np.where(sat, vmax, lo), np.where(sat, vmax, hi), np.where(sat, 0.0, p)


@functools.partial(jax.jit, static_argnums=1)
def _draws(xs, specs):
  """[(values [N, ...], dequantized [N, ...]) of xs[i] under specs[i]] for N_DRAWS keys
  (one compilation for several specs)."""
  keys = jax.random.split(jax.random.key(11), N_DRAWS)

  def one(k):
    qs = [formats.quantize(x, spec, -1, k, values_dtype=jnp.float32)
          for x, spec in zip(xs, specs)]
    return [(q.values, q.dequantize()) for q in qs]

  return jax.vmap(one)(keys)


def expected_round_up(p, spec):
  """The probability that the magnitude rounds up, for fractions p (float64)."""
  if spec.sr_bits < 24:
    p = np.floor(p * 2.0**spec.sr_bits) / 2.0**spec.sr_bits
  return np.minimum(1.0, p * spec.sr_round_up_scale)


def check_sr_distribution(specs, saturate=False):
  """The three properties of the module docstring for each of `specs`; returns
  the number of values tested per spec."""
  blocks = [_blocks(spec, saturate) for spec in specs]
  draws = _draws(tuple(jnp.asarray(b[0]) for b in blocks), tuple(specs))
  return [_check_draws(spec, *b, *(np.asarray(a, np.float64) for a in d))
          for spec, b, d in zip(specs, blocks, draws)]


def _check_draws(spec, x, scale, tested, values, deq):
  v = x / scale
  grid = ref.element_grid(spec.element.name)
  lo, hi, frac = _magnitude_neighbours(v, spec.element_max, grid)
  lo, hi, frac, v = (a[tested] for a in (lo, hi, frac, v))
  mags = np.abs(values[:, tested])
  # 1. one of the two neighbours, with the input's sign (or zero)
  ok = ((mags == lo) | (mags == hi)) & (
      (np.sign(values[:, tested]) == np.sign(v)) | (values[:, tested] == 0))
  assert ok.all(), f"{spec}: results outside the two neighbours at {v[~ok.all(0)][:5]}"
  # 2. the round-up rate is the fraction (binomial, Bonferroni over the values)
  p_up = expected_round_up(frac, spec)
  up = np.sum((mags == hi) & (hi != lo), axis=0)
  pv = binomial_two_sided_p(up, N_DRAWS, np.where(hi == lo, 0.0, p_up))
  bad = pv < ALPHA / len(v)
  assert not np.any(bad), (f"{spec}: round-up rates {up[bad][:5] / N_DRAWS} where "
                           f"{p_up[bad][:5]} expected, at scaled values {v[bad][:5]}")
  # 3. the mean converges to the expected value (the input for unbiased SR)
  s = scale[np.nonzero(tested)[0], 0]
  want = np.sign(v) * (lo + p_up * (hi - lo)) * s
  sd = (hi - lo) * s * np.sqrt(p_up * (1 - p_up))
  z = math.sqrt(2) * _inverse_erfc(ALPHA / len(v))
  mean = np.mean(deq[:, tested], axis=0)
  assert np.all(np.abs(mean - want) <= z * sd / math.sqrt(N_DRAWS) + 1e-12 * np.abs(want)), (
      f"{spec}: means off")
  return len(v)


def _inverse_erfc(y):
  """x with erfc(x) = y, by bisection (y in (0, 1))."""
  lo, hi = 0.0, 10.0
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if math.erfc(mid) > y else (lo, mid)
  return lo


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_sr_rounds_up_at_the_rate_of_the_fraction(fmt):
  """Every scale rule of the format (MX: all four)."""
  modes = formats.SCALE_MODES if fmt.startswith("mx") else ("floor",)
  counts = check_sr_distribution([formats.QuantSpec(fmt, scale_mode=m, rounding="stochastic")
                                  for m in modes])
  n_grid = len(ref.element_grid(formats.QuantSpec(fmt).element.name))
  assert min(counts) >= 2 * n_grid  # ceil reaches half the grid, the rest all of it


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2", "mxfp8_e5m2"])
def test_sr_saturates_above_the_element_max(fmt):
  """Floor rule, anchors between max and the next binade: they round to max."""
  check_sr_distribution([formats.QuantSpec(fmt, rounding="stochastic")], saturate=True)


@pytest.mark.parametrize("fmt,sr", [
    ("mxfp4", dict(sr_round_up_scale=0.5)),
    ("mxfp8_e4m3", dict(sr_bits=8)),
    ("nvfp4", dict(sr_round_up_scale=0.5)),
    ("fp8_e5m2", dict(sr_bits=8, sr_round_up_scale=0.5)),
    ("mxfp6_e2m3", dict(sr_bits=16, sr_round_up_scale=0.25)),
])
def test_biased_and_few_bit_sr_round_up_at_their_rates(fmt, sr):
  """Round-up probability: the fraction truncated to sr_bits bits, times
  sr_round_up_scale (the magnitude: a shrink toward zero)."""
  check_sr_distribution([formats.QuantSpec(fmt, rounding="stochastic", **sr)])


def test_the_binomial_test_rejects_a_halved_rate():
  """The test's own power: unbiased SR judged against x0.5 rates fails."""
  spec = formats.QuantSpec("mxfp4", rounding="stochastic")
  biased_view = formats.QuantSpec("mxfp4", rounding="stochastic", sr_round_up_scale=0.5)
  x, scale, tested = _blocks(spec)
  values = np.asarray(_draws((jnp.asarray(x),), (spec,))[0][0], np.float64)
  lo, hi, frac = _magnitude_neighbours(x / scale, spec.element_max,
                                       ref.element_grid("e2m1"))
  up = np.sum(np.abs(values) == hi, axis=0)[tested & (hi != lo)]
  pv = binomial_two_sided_p(up, N_DRAWS, expected_round_up(frac[tested & (hi != lo)], biased_view))
  assert np.sum(pv < ALPHA / len(pv)) > len(pv) / 2
