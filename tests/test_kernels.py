"""fp4jax.kernels.quantize against the XLA reference, bit for bit.

On the CPU the kernels run interpreted (interpret=None); on a GPU the same
tests run them compiled (interpret=None follows the lowering target:
fp4jax.kernels.target). Small tiles make every grid multi-tile with partial
tiles along both axes; N = 80 needs padding to the 32-element block.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from fp4jax.numerics import elements
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.kernels import quantize as kq
from tests.cuda_lowering import lower_for_cuda
from tests.helpers import jaxpr_equations

M, N = 24, 80  # rows, blocked length (80 = 2.5 blocks of 32, 5 of 16)
TILE = {"row": (16, 32), "col": (32, 16)}


def _data(dtype=jnp.float32, seed=0):
  """[M, N] values over many binades, with special blocks along N.

  Row 1 has a NaN in its first block, row 2 a zero block, row 3 an Inf,
  row 4 E2M1 ties (x.5 of the grid spacing), rows 5 and 6 FP32 subnormal and
  near-overflow values.
  """
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (M, N)) * jnp.exp2(
      jax.random.randint(k2, (M, N), -12, 12).astype(jnp.float32))
  ties = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
  x = x.at[1, 5].set(jnp.nan).at[2, 32:64].set(0.0).at[3, 70].set(jnp.inf)
  x = x.at[4, :32].set(ties * 8.0).at[5].set(x[5] * 1e-40).at[6].set(x[6] * 1e36)
  return x.astype(dtype)


def _layout(x, layout, hadamard_block=None):
  """The [M, N] data with N as the blocked axis of each layout: (x, axis).

  A Hadamard block of 32 needs N = 64 (the rotation does not pad).
  """
  if hadamard_block == 32:
    x = x[:, :64]
  if layout == "row":
    return x, -1
  if layout == "col":
    return x.T, 0
  return x.reshape(2, M // 2, -1).transpose(1, 2, 0), 1  # [M/2, N, 2], axis 1


def _assert_bits_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  if a.dtype.kind == "f" or a.dtype.name.startswith(("float8", "bfloat")):
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    np.testing.assert_array_equal(nan_a, nan_b)
    ints = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    a, b = np.where(nan_a, 0, a.view(ints)), np.where(nan_b, 0, b.view(ints))
  np.testing.assert_array_equal(a, b)


# The references, jitted (compiling one program beats dispatching op by op).
@functools.partial(jax.jit, static_argnames=("spec", "axis", "hadamard_block"))
def _reference_packed(x, spec, axis, hadamard_block=None, key=None):
  if hadamard_block:
    x = hadamard.rotate(x, hadamard_block, axis)
  q = formats.quantize(x, spec, axis, key)
  return formats.pack_fp4(q.values, axis), q.scales


@functools.partial(jax.jit, static_argnames=("spec", "axis", "hadamard_block"))
def _reference_fake(x, spec, axis, hadamard_block=None, signs=None, key=None):
  if hadamard_block:
    x = hadamard.rotate(x, hadamard_block, axis, signs)
  return formats.fake_quantize(x, spec, axis, key)


@hypothesis.settings(max_examples=2, deadline=None, derandomize=True)
@hypothesis.given(
    dims=st.lists(st.integers(1, 40), min_size=0, max_size=2),
    half_n=st.integers(1, 50), where=st.integers(0, 2),
    mode=st.sampled_from(formats.SCALE_MODES), seed=st.integers(0, 2**16))
def test_random_shapes_match_reference(dims, half_n, where, mode, seed):
  """Packed codes and scales on a random shape, with the blocked axis anywhere."""
  axis = min(where, len(dims))
  shape = tuple(dims[:axis]) + (2 * half_n,) + tuple(dims[axis:])
  spec = formats.QuantSpec("mxfp4", scale_mode=mode)
  x = jax.random.normal(jax.random.key(seed), shape) * 100
  for got, want in zip(kq.quantize_packed(x, spec, axis), _reference_packed(x, spec, axis)):
    _assert_bits_equal(got, want)


def test_e2m1_codes_and_values_match_the_casts():
  grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
  q = jnp.asarray(np.concatenate([grid, -grid, [np.nan, -np.nan]]))
  want = lax.bitcast_convert_type(q.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
  np.testing.assert_array_equal(elements.e2m1_codes(q), want)
  codes = jnp.arange(16, dtype=jnp.int32)
  values = lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
  _assert_bits_equal(elements.e2m1_values(codes), values.astype(jnp.float32))


# All four scale modes row-wise; column-wise here floor, and even and ceil in
# the fake-quantize tests below (each case costs one kernel compile).
@pytest.mark.parametrize("mode,layout", [(m, "row") for m in formats.SCALE_MODES]
                         + [("floor", "col")])
def test_packed_matches_reference(mode, layout):
  spec = formats.QuantSpec("mxfp4", scale_mode=mode)
  x, axis = _layout(_data(), layout)
  codes, scales = kq.quantize_packed(x, spec, axis, tile=TILE[layout])
  want_codes, want_scales = _reference_packed(x, spec, axis)
  _assert_bits_equal(codes, want_codes)
  _assert_bits_equal(scales, want_scales)
  assert scales.dtype == jnp.float8_e8m0fnu


@pytest.mark.parametrize("layout,hadamard_block", [("row", 16), ("col", 32)])
def test_packed_with_hadamard_matches_reference(layout, hadamard_block):
  spec = formats.QuantSpec("mxfp4", scale_mode="even")
  x, axis = _layout(_data(jnp.bfloat16, seed=1), layout, hadamard_block)
  got = kq.quantize_packed(x, spec, axis, hadamard_block=hadamard_block,
                           tile=TILE[layout])
  (codes, scales), (want_codes, want_scales) = got, _reference_packed(
      x, spec, axis, hadamard_block)
  _assert_bits_equal(_unsigned_zeros(codes), _unsigned_zeros(want_codes))
  _assert_bits_equal(scales, want_scales)


def _unsigned_zeros(packed):
  """Packed E2M1 codes with -0 (code 8) written as +0: a rotated block whose
  terms cancel sums to a zero whose sign depends on the CPU GEMM's order (on an
  AMX Xeon the kernel's and the reference's dots differ there), not on the
  quantizer."""
  p = np.asarray(packed)
  low, high = p & 0xF, p >> 4
  return (np.where(low == 8, 0, low) | (np.where(high == 8, 0, high) << 4)).astype(p.dtype)


@pytest.mark.parametrize("layout,mode,hadamard_block,signs,dtype", [
    ("row", "rceil", None, None, jnp.bfloat16),
    ("col", "even", 16, None, jnp.float32),
    ("mid", "floor", 32, "fixed", jnp.bfloat16),
    ("col", "ceil", 16, "key", jnp.bfloat16),
])
def test_fake_quantize_matches_reference(layout, mode, hadamard_block, signs, dtype):
  spec = formats.QuantSpec("mxfp4", scale_mode=mode)
  if signs == "key":
    signs = jax.random.key(7)
  elif signs == "fixed":
    signs = hadamard.random_signs(jax.random.key(8), hadamard_block)
  x, axis = _layout(_data(dtype, seed=2), layout, hadamard_block)
  tile = TILE["row" if layout == "row" else "col"]
  got = kq.fake_quantize(x, spec, axis, hadamard_block=hadamard_block, signs=signs,
                         tile=tile)
  _assert_bits_equal(got, _reference_fake(x, spec, axis, hadamard_block, signs))


@pytest.mark.parametrize("layout,fmt,rounding,hadamard_block", [
    ("row", "mxfp4", "nearest", 16), ("col", "mxfp4", "stochastic", None),
    ("col", "mxfp8_e5m2", "nearest", None)])
def test_quantize_fp8_writes_the_reference_with_the_blocked_axis_last(
    layout, fmt, rounding, hadamard_block):
  """The mosaic backend's operands: formats.quantize's elements (as FP8) and scales
  (as 2^e), the blocked axis moved last and padded to whole blocks."""
  spec = formats.QuantSpec(fmt, scale_mode="even", rounding=rounding)
  x, axis = _layout(_data(jnp.bfloat16, seed=2), layout)
  key = jax.random.key(3) if spec.is_random else None
  values, scales = kq.quantize_fp8(x, spec, axis, hadamard_block=hadamard_block, key=key,
                                   tile=TILE[layout])
  rotated = hadamard.rotate(x, hadamard_block, axis) if hadamard_block else x
  q = formats.quantize(jnp.pad(rotated, [(0, 16) if d == axis % 2 else (0, 0)
                                         for d in range(2)]), spec, axis, key)
  want = q.values.astype(kq.fp8_dtype(spec)), q.scales.astype(jnp.float32)
  if axis == 0:
    want = tuple(w.T for w in want)
  _assert_bits_equal(scales, want[1])
  # A NaN block is NaN in its scale; its elements (E2M1 has no NaN) may differ.
  finite = np.repeat(np.isfinite(np.asarray(scales)), spec.block, axis=-1)
  _assert_bits_equal(jnp.where(finite, values, 0), jnp.where(finite, want[0], 0))


def test_nan_block_gives_nan_scale_in_every_shape():
  """A NaN anywhere in a block makes its scale 0xFF and the block NaN.

  Checked on its own, not only against the reference: XLA:CPU's float max
  reduction drops NaNs for some shapes (a [2, 32, 64] max over axis 1 does),
  which is why the amax is an integer max of the magnitude bits.
  """
  spec = formats.QuantSpec("mxfp4")
  x = jnp.ones((64, 64)).at[3, :].set(jnp.nan)
  _, scales = kq.quantize_packed(x, spec, 0)
  bits = np.asarray(lax.bitcast_convert_type(scales, jnp.uint8))
  np.testing.assert_array_equal(bits, np.stack([np.full(64, 0xFF), np.full(64, 125)]))  # 2^-2: amax 1


def test_fake_quantize_default_tiles_other_mx_format():
  spec = formats.QuantSpec("mxfp8_e4m3", scale_mode="rceil")
  x = _data(jnp.bfloat16, seed=3)
  _assert_bits_equal(kq.fake_quantize(x, spec, -1), _reference_fake(x, spec, -1))


def test_stochastic_packed_matches_reference_given_the_same_bits():
  spec = formats.QuantSpec("mxfp4", rounding="stochastic")
  x, axis = _layout(_data(seed=4), "col")
  key = jax.random.key(11)
  bits = kq.reference_bits(key, x.shape, axis, spec.block)
  got = kq.quantize_packed(x, spec, axis, random_bits=bits, tile=TILE["col"])
  for g, w in zip(got, _reference_packed(x, spec, axis, key=key)):
    _assert_bits_equal(g, w)


def test_stochastic_fake_quantize_from_key_matches_reference():
  spec = formats.QuantSpec("mxfp4", scale_mode="even", rounding="stochastic")
  x = _data(jnp.bfloat16, seed=5)
  key = jax.random.key(12)
  got = kq.fake_quantize(x, spec, -1, hadamard_block=16, key=key, tile=TILE["row"])
  want = _reference_fake(x, spec, -1, 16, key=key)
  _assert_bits_equal(got, want)
  other = kq.fake_quantize(x, spec, -1, hadamard_block=16, key=jax.random.key(13),
                           tile=TILE["row"])
  assert not np.array_equal(np.asarray(got, np.float32), np.asarray(other, np.float32))


def test_gradient_is_straight_through_the_rotation():
  spec = formats.QuantSpec("mxfp4")
  x = jax.random.normal(jax.random.key(6), (16, 64))
  w = jax.random.normal(jax.random.key(7), (16, 64))
  got = jax.jit(jax.grad(
      lambda x: jnp.sum(kq.fake_quantize(x, spec, 0, hadamard_block=16) * w)))(x)
  want = jax.jit(jax.grad(
      lambda x: jnp.sum(_reference_fake(x, spec, 0, 16) * w)))(x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_rejects_what_the_reference_rejects():
  assert kq.unsupported(formats.QuantSpec("mxfp4"), 16) is None
  assert "dither" in kq.unsupported(formats.QuantSpec("mxfp4", rounding="stochastic_dither"))
  assert "not a power of two" in kq.unsupported(formats.QuantSpec("mxfp4"), 24)
  x = jnp.ones((8, 48))
  with pytest.raises(ValueError, match="even length"):
    kq.quantize_packed(jnp.ones((8, 33)), formats.QuantSpec("mxfp4"))
  with pytest.raises(ValueError, match="MX QuantSpecs"):
    kq.fake_quantize(x, formats.QuantSpec("nvfp4"))
  with pytest.raises(ValueError, match="packs MXFP4 only"):
    kq.quantize_packed(x, formats.QuantSpec("mxfp8_e4m3"))
  with pytest.raises(ValueError, match="multiple of the Hadamard block 32"):
    kq.fake_quantize(x, formats.QuantSpec("mxfp4"), hadamard_block=32)
  with pytest.raises(ValueError, match="needs random_bits"):
    kq.fake_quantize(x, formats.QuantSpec("mxfp4", rounding="stochastic"))


def _lowered_for(platform, fn, *args):
  if platform == "cuda":
    return lower_for_cuda(fn, *args)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform,compiled", [("cuda", True), ("cpu", False)])
def test_interpret_follows_the_lowering_target(platform, compiled):
  """interpret=None: a Triton call when lowered for a GPU, whatever the default
  device; interpreted (no custom call) when lowered for the CPU."""
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  fn = lambda x: kq.fake_quantize(x, formats.QuantSpec("mxfp4"), -1, hadamard_block=16)
  text = _lowered_for(platform, fn, x)
  assert ("xla.gpu.triton" in text) == compiled
  assert ("stablehlo.custom_call" in text) == compiled


def test_interpret_none_runs_as_interpret_true_here():
  spec = formats.QuantSpec("mxfp4")
  default, interpreted = (kq.quantize_packed(_data(), spec, -1, hadamard_block=16, interpret=i)
                          for i in (None, True))
  for a, b in zip(default, interpreted):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_lowers_to_triton_for_cuda(axis, rounding):
  """The compiled GPU path: the kernel lowers to one Triton call, no transpose."""
  spec = formats.QuantSpec("mxfp4", rounding=rounding)
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  bits = jax.ShapeDtypeStruct((256, 512), jnp.uint32) if spec.is_random else None
  fn = lambda x, b: kq.quantize_packed(x, spec, axis, hadamard_block=16, random_bits=b,
                                       interpret=False)
  text = lower_for_cuda(fn, x, bits)
  assert text.count("xla.gpu.triton") == 1
  assert "stablehlo.transpose" not in text


@pytest.mark.parametrize("shape,axis", [((2, 2), -1), ((40, 6), -1), ((24, 80), -1),
                                        ((80, 24), 0), ((3, 30, 5), 1)])
def test_kernels_read_and_write_whole_tiles(shape, axis):
  """Triton does not mask a tile at an array's edge (a partial tile wrote over the
  next row's codes on an H200): every block of every kernel call lies inside its
  array, on shapes that do not tile (the calls are traced, not run)."""
  spec, sr = formats.QuantSpec("mxfp4"), formats.QuantSpec("mxfp4", rounding="stochastic")
  s = jax.ShapeDtypeStruct
  x, bits = s(shape, jnp.bfloat16), s(shape, jnp.uint32)
  calls = [(lambda x: kq.quantize_packed(x, spec, axis), (x,)),
           (lambda x, b: kq.quantize_packed(x, sr, axis, random_bits=b), (x, bits)),
           (lambda x: kq.fake_quantize(x, spec, axis), (x,))]
  calls.append((lambda x: kq.quantize_fp8(x, spec, axis), (x,)))
  for fn, args in calls:
    eqns = [e for e in jaxpr_equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "pallas_call"]
    mappings = [m for eqn in eqns for m in eqn.params["grid_mapping"].block_mappings]
    assert mappings, fn
    for m in mappings:
      # A block dim is an int or Blocked(block_size) by jax's release; None / Squeezed: one.
      sizes = [getattr(b, "block_size", b) for b in m.block_shape]
      dims = [(b, a) for b, a in zip(sizes, m.array_aval.shape) if isinstance(b, int)]
      assert len(dims) >= 2 and all(a % b == 0 for b, a in dims), (
          shape, axis, m.block_shape, m.array_aval.shape)


class _NanDroppingClip:
  """jax.numpy with clip as Triton lowers float min/max (minnumf/maxnumf: NaN dropped)."""

  def __getattr__(self, name):
    return getattr(jnp, name)

  @staticmethod
  def clip(x, lo, hi):
    return jnp.fmax(jnp.fmin(x, hi), lo)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nan_survives_a_nan_dropping_min_max(monkeypatch, rounding):
  """On an H200 the packed kernel coded the elements of NaN blocks (a NaN or an Inf
  among them) as +-6 where XLA codes NaN: Triton's min/max drop NaN. With the
  rounding's clip made NaN-dropping, the interpreted kernel still gives the reference."""
  spec = formats.QuantSpec("mxfp4", rounding=rounding)
  x = _data()[:8, :64]  # rows 1 and 3: a NaN and an Inf block
  key = jax.random.key(3) if spec.is_random else None
  bits = kq.reference_bits(key, x.shape, -1, spec.block) if spec.is_random else None
  want = _reference_packed(x, spec, -1, key=key)
  monkeypatch.setattr(elements, "jnp", _NanDroppingClip())
  jax.clear_caches()
  try:
    got = kq.quantize_packed(x, spec, -1, random_bits=bits, interpret=True)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  for g, w in zip(got, want):
    _assert_bits_equal(g, w)
