"""QuantSpec/QArray API, errors, layout, packing, gradients, stochastic
rounding statistics and hypothesis properties of fp4jax.numerics.formats."""

import functools

import chex
import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import formats
from tests.helpers import row_scaled_normal

MX = [f for f in formats.FORMATS if f.startswith("mx")]


# --- specs and errors --------------------------------------------------------

def test_spec_defaults():
  assert formats.QuantSpec("mxfp4").block == 32
  assert formats.QuantSpec("nvfp4").block == 16
  assert formats.QuantSpec("fp8_e4m3").block is None
  assert formats.QuantSpec("mxfp4", block_size=16).block == 16
  assert formats.QuantSpec("mxfp4", rounding="stochastic").is_random
  assert not formats.QuantSpec("mxfp4").is_random
  assert formats.QuantSpec("mxfp4").element_dtype == jnp.float4_e2m1fn
  assert formats.QuantSpec("mxfp8_e5m2").element_max == 57344.0
  hash(formats.QuantSpec("nvfp4"))


@pytest.mark.parametrize("kwargs,valid", [
    (dict(fmt="mxfp5"), formats.FORMATS),
    (dict(fmt="mxfp4", scale_mode="round"), formats.SCALE_MODES),
    (dict(fmt="mxfp4", rounding="sr"), formats.ROUNDINGS),
])
def test_unknown_names_list_valid_ones(kwargs, valid):
  with pytest.raises(ValueError) as e:
    formats.QuantSpec(**kwargs)
  for name in valid:
    assert name in str(e.value)
  assert repr(list(kwargs.values())[-1]) in str(e.value)


def test_bad_specs():
  with pytest.raises(ValueError, match="positive"):
    formats.QuantSpec("mxfp4", block_size=0)
  with pytest.raises(ValueError, match="positive"):
    formats.QuantSpec("mxfp4", block_size=-32)
  with pytest.raises(TypeError, match="block_size"):
    formats.QuantSpec("mxfp4", block_size=32.0)
  with pytest.raises(ValueError, match="MX formats"):
    formats.QuantSpec("nvfp4", scale_mode="rceil")


def test_bad_inputs():
  spec = formats.QuantSpec("mxfp4")
  for bad in (jnp.ones((4, 32), jnp.int32), jnp.ones((4, 32), jnp.complex64)):
    with pytest.raises(TypeError, match=str(bad.dtype)):
      formats.quantize(bad, spec)
    with pytest.raises(TypeError, match=str(bad.dtype)):
      formats.fake_quantize(bad, spec)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    formats.fake_quantize(jnp.ones((32,)),
                          formats.QuantSpec("mxfp4", rounding="stochastic"))
  with pytest.raises(ValueError, match="axis 2 out of range"):
    formats.quantize(jnp.ones((4, 32)), spec, axis=2)
  for axis in (1.5, "1", None, True):
    with pytest.raises(TypeError, match=r"axis must be an int in \[-2, 2\)"):
      formats.quantize(jnp.ones((4, 32)), spec, axis=axis)
  assert formats.quantize(jnp.ones((4, 32)), spec, axis=np.int64(1)).axis == 1
  with pytest.raises(TypeError, match="QuantSpec"):
    formats.quantize(jnp.ones((32,)), "mxfp4")
  with pytest.raises(TypeError, match="int32"):
    formats.quantize([1] * 32, spec)           # Python lists go through jnp.asarray
  np.testing.assert_array_equal(formats.fake_quantize([0.5] * 32, spec), [0.5] * 32)
  with pytest.raises(ValueError, match="random_bits"):
    formats.round_to_element(jnp.ones(3),
                             formats.QuantSpec("mxfp4", rounding="stochastic"))


# --- layout ------------------------------------------------------------------

@pytest.mark.parametrize("fmt,shape,axis,scale_shape", [
    ("mxfp4", (8, 64), -1, (8, 2)),
    ("mxfp4", (64, 8), 0, (2, 8)),
    ("mxfp4", (3, 33, 5), 1, (3, 2, 5)),    # padded: 33 -> 64
    ("nvfp4", (4, 40), 1, (4, 3)),          # padded: 40 -> 48
    ("fp8_e5m2", (4, 40), 1, ()),
])
def test_shapes_and_dtypes(fmt, shape, axis, scale_shape):
  spec = formats.QuantSpec(fmt)
  x = jnp.asarray(row_scaled_normal(shape, 0))
  q = jax.jit(formats.quantize, static_argnums=(1, 2))(x, spec, axis)
  assert q.values.shape == shape and q.values.dtype == spec.element_dtype
  assert q.scales.shape == scale_shape and q.scales.dtype == spec.scale_dtype
  assert (q.global_scale is not None) == (fmt == "nvfp4")
  leaves, tree = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 2 + (fmt == "nvfp4")
  assert jax.tree_util.tree_unflatten(tree, leaves).spec == spec


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e4m3"])
def test_fake_quantize_is_quantize_dequantize(fmt, dtype):
  """Bit for bit, along both axes of a padded [6, 50] array, stochastic."""
  x = jnp.asarray(row_scaled_normal((6, 50), 1) / 2**10, dtype)  # f16-safe magnitudes
  spec = formats.QuantSpec(fmt, rounding="stochastic")
  key = jax.random.key(3)

  @jax.jit
  def run(x):
    return [(formats.fake_quantize(x, spec, a, key),
             formats.quantize(x, spec, a, key).dequantize(dtype))
            for a in (0, 1)]

  for y, want in run(x):
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(want, np.float32))


def test_nan_wins_for_many_shapes():
  """A NaN anywhere in a block poisons exactly that block."""
  spec = formats.QuantSpec("mxfp4")
  for shape, axis in [((7, 96), 1), ((96, 7), 0), ((2, 64, 3), 1)]:
    x = np.ones(shape, np.float32)
    idx = tuple(s // 2 for s in shape)
    x[idx] = np.nan
    y = np.asarray(jax.jit(formats.fake_quantize, static_argnums=(1, 2))(
        jnp.asarray(x), spec, axis))
    nan_block = np.zeros(shape, bool)
    sl = list(idx)
    b = idx[axis] // 32
    sl[axis] = slice(32 * b, 32 * b + 32)
    nan_block[tuple(sl)] = True
    np.testing.assert_array_equal(np.isnan(y), nan_block)


def test_nvfp4_and_fp8_scales():
  x = jnp.asarray(row_scaled_normal((4, 64), 2))
  amax = np.float32(np.abs(np.asarray(x)).max())
  quant = jax.jit(formats.quantize, static_argnums=1)
  q = quant(x, formats.QuantSpec("nvfp4"))
  assert np.float32(q.global_scale) == amax * np.float32(1 / 2688)
  assert np.asarray(q.scales, np.float32).max() <= 448.0
  assert np.abs(np.asarray(q.values, np.float32)).max() == 6.0
  q = quant(x, formats.QuantSpec("fp8_e4m3"))
  assert np.float32(q.scales) == amax * np.float32(1 / 448)
  assert np.abs(np.asarray(q.values, np.float32)).max() == 448.0


def test_straight_through_gradient():
  x = jnp.asarray(row_scaled_normal((4, 64), 4), jnp.bfloat16)
  w = jnp.asarray(row_scaled_normal((4, 64), 5), jnp.bfloat16)
  for spec, key in [(formats.QuantSpec("mxfp4"), None),
                    (formats.QuantSpec("nvfp4", rounding="stochastic"),
                     jax.random.key(0))]:
    g = jax.jit(jax.grad(lambda x: jnp.sum(
        formats.fake_quantize(x, spec, 0, key) * w)))(x)
    assert g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --- packing ---------------------------------------------------------------

def test_pack_nibble_order():
  v = jnp.asarray([0.5, 1.0, -6.0, 0.0], jnp.float4_e2m1fn)
  np.testing.assert_array_equal(formats.pack_fp4(v), [0x21, 0x0F])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_pack_round_trip(axis):
  @jax.jit
  def run(x):
    q = formats.quantize(x, formats.QuantSpec("mxfp4", block_size=2), axis)
    packed = formats.pack_fp4(q.values, axis)
    return q.values, packed, formats.unpack_fp4(packed, axis)

  values, packed, unpacked = run(jnp.asarray(row_scaled_normal((6, 8, 10), 6)))
  assert packed.dtype == jnp.uint8
  assert packed.shape[axis] == values.shape[axis] // 2
  np.testing.assert_array_equal(np.asarray(unpacked, np.float32),
                                np.asarray(values, np.float32))


def test_pack_errors():
  with pytest.raises(ValueError, match="even"):
    formats.pack_fp4(jnp.zeros((3,), jnp.float4_e2m1fn))
  with pytest.raises(TypeError, match="float4_e2m1fn"):
    formats.pack_fp4(jnp.zeros((4,), jnp.float32))
  with pytest.raises(ValueError, match="axis 1 out of range"):
    formats.pack_fp4(jnp.zeros((4,), jnp.float4_e2m1fn), axis=1)
  with pytest.raises(ValueError, match="axis -2 out of range"):
    formats.unpack_fp4(jnp.zeros((4,), jnp.uint8), axis=-2)


# --- stochastic rounding ---------------------------------------------------

N_KEYS = 4096


@functools.partial(jax.jit, static_argnums=1)
def _mean_over_keys(x, spec):
  keys = jax.random.split(jax.random.key(0), N_KEYS)
  ys = jax.vmap(lambda k: formats.fake_quantize(x, spec, -1, k))(keys)
  return jnp.mean(ys, axis=0), jnp.max(jnp.abs(ys - x), axis=0)


@pytest.mark.parametrize("fmt,mode,rounding", [
    ("mxfp4", "rceil", "stochastic"),
    ("mxfp4", "floor", "stochastic_dither"),
    ("mxfp6_e3m2", "even", "stochastic_dither"),
    ("nvfp4", "floor", "stochastic_dither"),
])
def test_stochastic_is_unbiased(fmt, mode, rounding):
  """|mean - x| <= 5 standard errors: each draw lies within one grid gap
  (<= gap_max) of x, so its standard deviation is <= gap_max / 2 and the mean
  of N_KEYS draws has standard error <= gap_max / (2 sqrt(N_KEYS)). The
  largest observed |y - x| stands in for gap_max (an upper bound on it)."""
  x = jnp.asarray(row_scaled_normal((1, 64), 7)[0])
  x = x.at[3].set(7.9 * jnp.max(jnp.abs(x)))  # a block max that floor clips
  mean, max_dev = _mean_over_keys(x, formats.QuantSpec(fmt, scale_mode=mode,
                                                       rounding=rounding))
  bound = 5 * max_dev / (2 * np.sqrt(N_KEYS))
  assert np.all(np.abs(np.asarray(mean - x)) <= np.asarray(bound) + 1e-30)


def test_plain_stochastic_floor_is_biased_where_it_clips():
  """The reason for the dither: with the floor rule the block max clips."""
  x = jnp.zeros((32,)).at[0].set(7.5)
  mean, _ = _mean_over_keys(x, formats.QuantSpec("mxfp4",
                                                 rounding="stochastic"))
  assert float(mean[0]) == 6.0


def test_stochastic_determinism():
  x = jnp.asarray(row_scaled_normal((8, 64), 8))
  fake = jax.jit(functools.partial(
      formats.fake_quantize,
      spec=formats.QuantSpec("mxfp4", rounding="stochastic")))
  a = fake(x, key=jax.random.key(1))
  b = fake(x, key=jax.random.key(1))
  c = fake(x, key=jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2", "mxfp8_e4m3",
                                 "fp8_e5m2"])
def test_dither_never_clips(fmt):
  """For every scale rule, amax * 3/4 <= max * scale in every block, and each
  dithered value is within one top-binade grid gap (times scale * 4/3) of x,
  which clipping would break."""
  x = jnp.asarray(np.random.default_rng(9).standard_t(2, (64, 128)),
                  jnp.float32)
  key = jax.random.key(0)
  specs = [formats.QuantSpec(fmt, scale_mode=m, rounding="stochastic_dither")
           for m in (formats.SCALE_MODES if fmt in MX else ("floor",))]
  results = jax.jit(lambda x: [(formats.quantize(x, s, key=key),
                                formats.fake_quantize(x, s, key=key))
                               for s in specs])(x)
  x = np.asarray(x, np.float64)
  for spec, (q, y) in zip(specs, results):
    if spec.family == "mx":
      s = np.exp2(np.asarray(q.scales.view(jnp.uint8), np.float64) - 127)
      s = np.repeat(s, spec.block, axis=-1)
    else:
      s = np.full(x.shape, np.float64(q.scales))
    amax = np.abs(x).reshape(64, -1, spec.block or 128).max(-1)
    assert np.all(amax * 0.75 <= spec.element_max * s[:, ::spec.block or 128])
    assert np.float32(q.global_scale) == np.float32(4 / 3)
    gap = 2.0**(spec.element.emax - spec.element.mbits)
    err = np.abs(np.asarray(y, np.float64) - x)
    assert np.all(err <= s * gap * 4 / 3 * (1 + 2**-20)), spec.scale_mode


# --- hypothesis properties ---------------------------------------------------

_BLOCKS = hnp.arrays(
    np.float32, (4, 32),
    elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False))
_EXPS = hnp.arrays(np.int32, (4, 1), elements=st.integers(-60, 60))


@functools.lru_cache(maxsize=None)
def _jitted(spec):
  return jax.jit(lambda x: (formats.quantize(x, spec),
                            formats.fake_quantize(x, spec)))


@pytest.mark.parametrize("fmt", MX)
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(blocks=_BLOCKS, exps=_EXPS)
def test_mx_error_bound_per_block(fmt, blocks, exps):
  """|y - x| <= half the top-binade gap s * 2^(emax - mbits - 1), plus, for
  floor and even, the clipping amax - max * s. (even clips too: it keeps the
  binade when amax rounds below 2^(emax+1), but E4M3's top binade stops at
  1.75 * 2^8, so amax / s in (448, 480) saturates.) ceil and rceil never clip.
  """
  x = blocks * np.exp2(exps).astype(np.float32)
  elem = formats.QuantSpec(fmt).element
  for mode in formats.SCALE_MODES:
    q, y = _jitted(formats.QuantSpec(fmt, scale_mode=mode))(jnp.asarray(x))
    s = np.exp2(np.asarray(q.scales.view(jnp.uint8), np.float64) - 127)
    amax = np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    bound = s * 2.0**(elem.emax - elem.mbits - 1)
    if mode in ("floor", "even"):
      bound = np.maximum(bound, amax - elem.max * s)
    else:
      assert np.all(amax <= elem.max * s)
    err = np.abs(np.asarray(y, np.float64) - x)
    # A block whose scale is an FP32 subnormal (2^-127) dequantizes through
    # XLA:CPU's flush-to-zero (docs/numerics.md): its bound is |x|.
    bound = np.where(s < 2.0**-126, np.maximum(bound, np.abs(x)), bound)
    assert np.all(err <= bound), mode


@pytest.mark.parametrize("fmt", MX + ["fp8_e4m3", "fp8_e5m2"])
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(blocks=_BLOCKS, exps=_EXPS)
def test_nearest_is_idempotent(fmt, blocks, exps):
  """Exact for MX (power-of-two scales). FP8 scales are recomputed from the
  dequantized amax in float32, so a second pass may move values by a float32
  rounding (relative 2^-22 here). NVFP4 is not idempotent: a new global
  scale can move a block scale deep in E4M3's subnormal range by a whole
  step."""
  x = jnp.asarray(blocks * np.exp2(exps).astype(np.float32))
  modes = formats.SCALE_MODES if fmt in MX else ("floor",)
  for mode in modes:
    fn = _jitted(formats.QuantSpec(fmt, scale_mode=mode))
    y = fn(x)[1]
    if fmt in MX:
      chex.assert_trees_all_equal(fn(y)[1], y)
    else:
      np.testing.assert_allclose(fn(y)[1], y, rtol=2**-22, atol=0)
