"""fp4jax.kernels.hopper_gemm and the `mosaic` and `mosaic_fast` backends on the CPU.

The kernel runs in jax's Mosaic GPU interpreter (jax >= 0.11; the tests skip,
naming the installed jax, before that). What is asserted:
- the interpreted kernel equals its jnp reference (block partials summed in K
  order) bit for bit, scaled E2M1 and unscaled E4M3 x E5M2, on shapes that tile
  and that do not;
- through fp4jax.dot_general, forward and backward, the backend with the
  interpreted kernel equals the backend's CPU program (the reference) bit for bit;
- that program equals the xla emulation bit for bit for E2M1 recipes where every
  GEMM contracts one 32-block (then no summation order can differ), and within
  float32 summation-order error elsewhere (and for fp8, whose block sums round);
- the fast mode (one promotion per 128 of K): its interpreted kernel equals its
  reference bit for bit; its fold of 32-block scales into E4M3 elements is exact
  when a chunk's blocks span at most 14 binades and counts the values it loses
  beyond; through fp4jax.dot_general, forward and backward, `mosaic_fast` is the
  exact backend within the tensor core's truncation bound (mosaic_fast's
  docstring) for mxfp4, mxfp4-dh16, nvfp4 and fp8. The GPU's bits are not
  checked here (no GPU).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot, recipes
from fp4jax.backends import mosaic_fast
from fp4jax.kernels import hopper_gemm

pytestmark = pytest.mark.skipif(hopper_gemm.unavailable() is not None,
                                reason=str(hopper_gemm.unavailable()))
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
DENSE = (((1,), (0,)), ((), ()))


def _e2m1(key, shape):
  codes = jax.random.randint(key, shape, 0, 16)
  values = jnp.asarray(E2M1)[codes % 8] * jnp.where(codes >= 8, -1.0, 1.0)
  return values.astype(jnp.float8_e4m3fn)


def _pow2(key, shape):
  return 2.0 ** jax.random.randint(key, shape, -6, 7).astype(jnp.float32)


def test_interpreted_kernel_is_its_reference_bit_for_bit():
  m, n, k = 136, 128, 96  # rows: a whole 128-tile and a padded one; columns: one tile
  ka, kb, ksa, ksb = jax.random.split(jax.random.key(0), 4)
  a, b = _e2m1(ka, (m, k)), _e2m1(kb, (n, k))
  sa, sb = _pow2(ksa, (k // 32, m)), _pow2(ksb, (k // 32, n))
  got = hopper_gemm.matmul(a, b, sa, sb, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(hopper_gemm.reference(a, b, sa, sb)))
  # Unscaled FP8, the two element types mixed (Dgrad and Wgrad of the fp8 recipe).
  a8 = jax.random.normal(ka, (m, k)).astype(jnp.float8_e4m3fn)
  b8 = (100 * jax.random.normal(kb, (n, k))).astype(jnp.float8_e5m2)
  got = hopper_gemm.matmul(a8, b8, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(hopper_gemm.reference(a8, b8)))


def test_interpreted_fast_kernel_is_its_reference_bit_for_bit():
  """One promotion per 128 of K (a chain of four wgmmas); E2M1 values shifted by up to
  2 binades, as the fold makes them: every chunk sum is exact in float32, so any
  order gives the same bits."""
  m, n, k = 136, 128, 384
  ka, kb, ksa, ksb, kx = jax.random.split(jax.random.key(1), 5)
  shift = lambda key, shape: 2.0 ** jax.random.randint(key, shape, -2, 3).astype(jnp.float32)
  a = (_e2m1(ka, (m, k)).astype(jnp.float32) * shift(kx, (m, k))).astype(jnp.float8_e4m3fn)
  b = _e2m1(kb, (n, k))
  sa, sb = _pow2(ksa, (k // 128, m)), _pow2(ksb, (k // 128, n))
  got = hopper_gemm.matmul(a, b, sa, sb, interpret=True, block=hopper_gemm.CHUNK)
  want = hopper_gemm.reference(a, b, sa, sb, block=hopper_gemm.CHUNK)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  got = hopper_gemm.matmul(a, b.astype(jnp.float8_e5m2), interpret=True, block=hopper_gemm.CHUNK)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(hopper_gemm.reference(
      a, b.astype(jnp.float8_e5m2), block=hopper_gemm.CHUNK)))


def _blocks(exponents, seed=0):
  """E4M3 E2M1 values [1, 8, 32 * len(exponents)] and their scales [1, blocks, 8]
  2^exponents[j] for block j (every row alike)."""
  values = _e2m1(jax.random.key(seed), (1, 8, 32 * len(exponents)))
  scales = jnp.broadcast_to(2.0 ** jnp.asarray(exponents, jnp.float32)[None, :, None],
                            (1, len(exponents), 8))
  return values, scales


def test_the_fold_is_exact_within_14_binades():
  # Chunk 1 spans exactly 14 binades (-3 .. 11); chunk 2 has a zero block; K is 5 blocks
  # (padded to two chunks).
  values, scales = _blocks([11, -3, 4, 0, 7])
  values = values.at[:, :, 96:128].set(0)
  folded, chunk_scales, lost = mosaic_fast.fold(values, scales)
  assert folded.dtype == jnp.float8_e4m3fn and folded.shape == (1, 8, 256)
  assert int(lost) == 0
  dequantized = (values.astype(jnp.float32).reshape(1, 8, 5, 32)
                 * jnp.swapaxes(scales, 1, 2)[..., None]).reshape(1, 8, 160)
  refolded = (folded.astype(jnp.float32).reshape(1, 8, 2, 128)
              * jnp.swapaxes(chunk_scales, 1, 2)[..., None]).reshape(1, 8, 256)
  np.testing.assert_array_equal(np.asarray(refolded[..., :160]), np.asarray(dequantized))
  assert not np.any(np.asarray(refolded[..., 160:]))
  np.testing.assert_array_equal(np.asarray(chunk_scales[0, :, 0]), [2.0 ** 5, 2.0 ** 1])


def test_the_fold_counts_what_it_loses_beyond_14_binades():
  """A block 30 binades below its chunk's largest: shifted by 2^-24, every nonzero
  E2M1 value of it falls below E4M3's smallest subnormal and is lost."""
  values, scales = _blocks([10, -20, 10, 10])
  _, _, lost = mosaic_fast.fold(values, scales)
  assert int(lost) == int(np.count_nonzero(np.asarray(values[:, :, 32:64]).astype(np.float32)))
  assert int(lost) > 0


def _within_truncation(got, exact):
  """|fast - exact| within 4 x 2^-13 x sum |a||b| per chunk (mosaic_fast's bound),
  taking sum |a||b| <= 8 max |exact| as in the xla comparison below."""
  np.testing.assert_allclose(got, exact, rtol=0, atol=4 * 2.0**-13 * 8 * np.abs(exact).max())


# Fprop contracts K = 320 (three chunks, the last padded), Dgrad 72, Wgrad 40.
FAST_SHAPE = (40, 320, 72)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4-dh16", "nvfp4", "fp8"])
def test_the_fast_backend_is_the_exact_one_within_the_truncation_bound(name):
  for got, exact in zip(_fwd_bwd(name, "mosaic_fast", *FAST_SHAPE),
                        _fwd_bwd(name, "mosaic", *FAST_SHAPE)):
    _within_truncation(got, exact)


def test_the_fast_backend_interpreted_is_its_cpu_program():
  """mxfp4's folded GEMMs and fp8's unscaled chains, forward and backward, in the
  interpreter: the CPU program's bits."""
  for name in ("mxfp4", "fp8"):
    for got, ref in zip(_fwd_bwd(name, "mosaic_fast", *RAGGED, interpret=True),
                        _fwd_bwd(name, "mosaic_fast", *RAGGED)):
      np.testing.assert_array_equal(got, ref)


def test_the_kernel_refuses_operands_it_cannot_take():
  a = jnp.zeros((64, 48), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="K a multiple of 32"):
    hopper_gemm.matmul(a, a)
  a = jnp.zeros((64, 64), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=r"block scales must be \[K/32, M\]"):
    hopper_gemm.matmul(a, a, jnp.ones((2, 64)), None)


def _recipe(name, backend):
  return dataclasses.replace(recipes.recipe(name), backend=backend)


@functools.cache
def _fwd_bwd(name, backend, m, k, n, interpret=False):
  """(y, dx, dw) of the recipe's dot_general on x[m, k] . w[k, n] (normal, seeded),
  one jitted program; interpret: the kernel in jax's interpreter, not its reference."""
  kx, kw = jax.random.split(jax.random.key(m * k * n))
  x, w = jax.random.normal(kx, (m, k)), jax.random.normal(kw, (k, n)) / np.sqrt(k)
  dg = dot.dot_general(_recipe(name, backend))
  key = jax.random.key(7)

  def loss(x, w):
    y = dg(x, w, DENSE, key=key, layer_key=key)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), y

  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  if interpret:
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(hopper_gemm, "matmul", functools.partial(hopper_gemm.matmul, interpret=True))
      (_, y), (dx, dw) = run(x, w)
  else:
    (_, y), (dx, dw) = run(x, w)
  return [np.asarray(t) for t in (y, dx, dw)]


# Every GEMM of x[40, 64] . w[64, 72] contracts 2 or 3 blocks, and none tiles.
RAGGED = (40, 64, 72)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "fp8"])
def test_the_interpreted_kernel_is_the_backend_bit_for_bit_fwd_and_bwd(name):
  """MXFP4's 32-blocks, NVFP4's 16-blocks padded to 32 with E4M3 scales and global
  factors (its Wgrad; Fprop and Dgrad take xla for the weight's 2D tiles), fp8's
  unscaled E4M3 x E5M2."""
  for got, ref in zip(_fwd_bwd(name, "mosaic", *RAGGED, interpret=True),
                      _fwd_bwd(name, "mosaic", *RAGGED)):
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4-dh16", "mxfp4-sr", "nvfp4"])
def test_one_block_per_gemm_is_the_xla_emulation_bit_for_bit(name):
  for got, ref in zip(_fwd_bwd(name, "mosaic", 32, 32, 32), _fwd_bwd(name, "xla", 32, 32, 32)):
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "fp8"])
def test_many_blocks_are_the_xla_emulation_to_float32_summation_order(name):
  """(mxfp4-dh16 and mxfp4-sr quantize as mxfp4 after their rotation or with their
  bits, and the one-block test shows those operands are the emulation's.)"""
  for got, ref in zip(_fwd_bwd(name, "mosaic", *RAGGED), _fwd_bwd(name, "xla", *RAGGED)):
    # |error| <= (terms summed) * 2^-24 * sum |a||b|, and sum |a||b| is a few times
    # max |ref| here: a bound on the largest entry's scale holds with margin.
    np.testing.assert_allclose(got, ref, rtol=0, atol=96 * 2.0**-24 * 8 * np.abs(ref).max())
