"""Sylvester matrices and block-diagonal rotations (fp4jax.numerics.hadamard)."""

import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import hadamard


@pytest.mark.parametrize("n", [1, 2, 4, 16, 32, 128])
def test_matrix_is_orthonormal_symmetric(n):
  h = np.asarray(hadamard.hadamard_matrix(n), np.float64)
  np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
  np.testing.assert_array_equal(h, h.T)
  np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-7)
  if n == 16:
    assert np.all(np.abs(h) == 0.25)  # H16 is exact in any float format


@pytest.mark.parametrize("n", [0, 3, 12, -4, 2.0])
def test_matrix_rejects_non_powers_of_two(n):
  with pytest.raises(ValueError, match="power of two"):
    hadamard.hadamard_matrix(n)


def test_rotate_is_block_diagonal_matmul():
  """Each block of 16 along the axis is multiplied by diag(signs) @ H16."""
  x = np.random.default_rng(0).standard_normal((5, 64, 3)).astype(np.float32)
  signs = np.where(np.arange(16) % 3 == 0, -1.0, 1.0).astype(np.float32)
  m = np.diag(signs) @ np.asarray(hadamard.hadamard_matrix(16), np.float64)
  want = np.einsum("abij,ik->abkj", x.reshape(5, 4, 16, 3), m).reshape(x.shape)
  for axis, xx, ww in [(1, x, want),
                       (-1, np.moveaxis(x, 1, -1), np.moveaxis(want, 1, -1)),
                       (0, np.moveaxis(x, 1, 0), np.moveaxis(want, 1, 0))]:
    got = hadamard.rotate(jnp.asarray(xx), 16, axis, jnp.asarray(signs))
    np.testing.assert_allclose(got, ww, atol=1e-5)


@pytest.mark.parametrize("signs", ["none", "fixed", "key"])
@pytest.mark.parametrize("axis", [0, 1])
def test_inverse(signs, axis):
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)),
                  jnp.float32)
  s = {"none": None, "fixed": hadamard.random_signs(jax.random.key(4), 16),
       "key": jax.random.key(5)}[signs]
  y = hadamard.rotate(x, 16, axis, s)
  assert not np.allclose(y, x)
  np.testing.assert_allclose(hadamard.unrotate(y, 16, axis, s), x, atol=1e-5)
  if signs == "none":  # H is symmetric: rotating twice is the identity
    np.testing.assert_allclose(hadamard.rotate(y, 16, axis), x, atol=1e-5)
  else:  # the documented inverse: plain rotation, then the signs per block
    v = s if signs == "fixed" else hadamard.random_signs(s, 16)
    tile = np.tile(np.asarray(v), 64 // 16 if axis == 0 else 32 // 16)
    tile = tile[:, None] if axis == 0 else tile[None, :]
    np.testing.assert_allclose(hadamard.rotate(y, 16, axis) * tile, x,
                               atol=1e-5)


def test_gemm_invariance():
  """(A H)(B H)^T = A B^T when both operands rotate along the contraction."""
  rng = np.random.default_rng(2)
  a = rng.standard_normal((8, 64)).astype(np.float32)
  b = rng.standard_normal((5, 64)).astype(np.float32)
  s = jax.random.key(9)
  ra, rb = hadamard.rotate(a, 32, -1, s), hadamard.rotate(b, 32, -1, s)
  np.testing.assert_allclose(ra @ rb.T, a @ b.T, rtol=1e-4, atol=1e-4)


def test_random_signs():
  s = hadamard.random_signs(jax.random.key(0), 64)
  assert s.shape == (64,) and s.dtype == jnp.float32
  assert set(np.asarray(s).tolist()) == {-1.0, 1.0}
  np.testing.assert_array_equal(s, hadamard.random_signs(jax.random.key(0), 64))


def test_errors_and_dtype():
  with pytest.raises(ValueError, match="not a multiple"):
    hadamard.rotate(jnp.ones((4, 24)), 16)
  with pytest.raises(ValueError, match="shape"):
    hadamard.rotate(jnp.ones((4, 32)), 16, signs=jnp.ones(8))
  y = hadamard.rotate(jnp.ones((4, 32), jnp.bfloat16), 16)
  assert y.dtype == jnp.bfloat16 and y.shape == (4, 32)
  with pytest.raises(ValueError, match="axis 2 out of range"):
    hadamard.rotate(jnp.ones((4, 32)), 16, axis=2)
  with pytest.raises(TypeError, match="int32"):
    hadamard.rotate(jnp.ones((4, 32), jnp.int32), 16)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    x=hnp.arrays(np.float32, (32, 16),
                 elements=st.floats(-1e3, 1e3, width=32)),
    axis=st.sampled_from([0, 1]), block=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**31 - 1))
def test_rotation_preserves_norms_and_dots(x, axis, block, seed):
  """Orthogonality: norms of every block and inner products between fibres
  along the axis are preserved."""
  s = hadamard.random_signs(jax.random.key(seed), block)
  y = np.asarray(hadamard.rotate(jnp.asarray(x), block, axis, s), np.float64)
  x64 = x.astype(np.float64)
  tol = 1e-5 * (np.abs(x64).max() + 1) * block
  np.testing.assert_allclose(np.linalg.norm(y, axis=axis),
                             np.linalg.norm(x64, axis=axis), atol=tol)
  gx = x64 @ x64.T if axis == 1 else x64.T @ x64
  gy = y @ y.T if axis == 1 else y.T @ y
  np.testing.assert_allclose(gy, gx, atol=tol * (np.abs(x64).max() + 1) * 16)


def _bf16_samples(n=1 << 20):
  """{name: bf16 numpy-castable float32 [n // 256, 256]} of heavy- and light-tailed inputs."""
  rng = np.random.default_rng(0)
  shape = (n // 256, 256)
  sparse = rng.standard_normal(shape) * (rng.random(shape) < 0.1)
  raw = {"gaussian": rng.standard_normal(shape), "t3": rng.standard_t(3, shape),
         "cauchy": rng.standard_cauchy(shape), "lognormal-sd4": rng.lognormal(0, 4, shape)
         * rng.choice([-1, 1], shape), "sparse": sparse}
  return {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in raw.items()}


def _spread_at_most_12(x):
  """[rows, n/16, 1] bool: the block's nonzero values span at most 12 binades."""
  e = np.frexp(np.abs(x).reshape(x.shape[0], -1, 16))[1].astype(float)
  nonzero = x.reshape(e.shape) != 0
  hi = np.where(nonzero, e, -np.inf).max(-1, keepdims=True)
  lo = np.where(nonzero, e, np.inf).min(-1, keepdims=True)
  return (hi - lo <= 12) | ~nonzero.any(-1, keepdims=True)


@pytest.mark.parametrize("name", ["gaussian", "t3", "cauchy", "lognormal-sd4", "sparse"])
def test_bf16_rotation_is_exact_up_to_float32_ties(name):
  """A bf16 16-point rotation (bf16 operands, hadamard.matmul_dtype) against the
  exact rotation (float64, rounded to float32, then bf16): equal wherever a
  block spans at most 12 binades; elsewhere at most 1 in 10^4 differ, and the
  MXFP4 values of the two differ no more often."""
  from fp4jax.numerics import formats  # pylint: disable=g-import-not-at-top
  assert hadamard.matmul_dtype(jnp.bfloat16, 16) == jnp.bfloat16
  assert hadamard.matmul_dtype(jnp.bfloat16, 32) == jnp.float32
  assert hadamard.matmul_dtype(jnp.float32, 16) == jnp.float32
  x = _bf16_samples()[name]
  h = np.asarray(hadamard.hadamard_matrix(16), np.float64)
  exact = (x.astype(np.float64).reshape(x.shape[0], -1, 16) @ h).reshape(x.shape)
  want = jnp.asarray(exact.astype(np.float32), jnp.bfloat16)
  got = jax.jit(lambda v: hadamard.rotate(v, 16, -1))(jnp.asarray(x, jnp.bfloat16))
  same = np.asarray(got == want).reshape(x.shape[0], -1, 16)
  assert same[np.broadcast_to(_spread_at_most_12(x), same.shape)].all()
  assert 1 - same.mean() <= 1e-4, 1 - same.mean()
  q = lambda v: np.asarray(formats.fake_quantize(v, formats.QuantSpec("mxfp4"), -1))
  assert np.mean(q(got) != q(want)) <= 1 - same.mean()
