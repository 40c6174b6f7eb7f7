"""fp4jax's rceil MXFP4 against JAX's own block-scaled quantizer and GEMM.

JAX quantizes for `jax.nn.scaled_dot_general` in
jax._src.cudnn.scaled_matmul_stablehlo.quantize: scale = amax / max rounded up
to a power of two (rceil), elements cast with astype (round to nearest even).
jax >= 0.12 has an MXFP4 config of its own,
`jax.nn.get_scaled_dot_general_config("mxfp4")` (block 32, E2M1, E8M0); on
older jax the same quantizer is reached with a hand-made config, and the
scaled_dot_general comparison skips, naming the installed jax.
"""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot, recipes
from fp4jax.numerics import formats

SPEC = formats.QuantSpec("mxfp4", scale_mode="rceil")
_quantize = jax.jit(lambda x: formats.quantize(x, SPEC))


def _mxfp4_config():
  """JAX's MXFP4 BlockScaleConfig: its own where it has one (jax >= 0.12), else built."""
  try:
    return jax.nn.get_scaled_dot_general_config("mxfp4")
  except ValueError:  # jax < 0.12 knows mxfp8 and nvfp4 only
    sm = importlib.import_module("jax._src.cudnn.scaled_matmul_stablehlo")
    return sm.BlockScaleConfig(
        mode="mxfp8", block_size=32, data_type=jnp.float4_e2m1fn,
        scale_type=jnp.float8_e8m0fnu, global_scale=None, infer_only=False)


def _jax_block_quantize():
  try:
    sm = importlib.import_module("jax._src.cudnn.scaled_matmul_stablehlo")
  except ImportError as e:
    pytest.skip(f"JAX's block-scale quantizer is not importable: {e}")
  config = _mxfp4_config()
  return jax.jit(lambda x: sm.quantize(x, config))


def _inputs():
  """name -> [1, rows, 256] float32 arrays of one input class."""
  rng = np.random.default_rng(0)
  grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
  ties = (grid[:-1] + grid[1:]) / 2  # halfway between E2M1 neighbours
  tie_rows = rng.choice(np.concatenate([ties, -ties, grid]), (1, 32, 256))
  tie_rows[..., ::32] = 6.0  # every block's amax is 6: scale 1, the ties stay ties
  zero = rng.standard_normal((1, 16, 256))
  zero[:, ::2, 32:96] = 0.0  # whole zero blocks
  return {
      "heavy-tailed": rng.standard_t(2, (1, 48, 256)) * np.exp2(rng.integers(-20, 20, (1, 48, 1))),
      "ties": tie_rows * np.exp2(rng.integers(-6, 6, (1, 32, 1))),
      "zero blocks": zero,
      "near overflow": rng.uniform(-1, 1, (1, 16, 256)) * np.float32(3.3e38),
  }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", list(_inputs()))
def test_rceil_matches_jax_mxfp4_quantizer(kind, dtype):
  if dtype == jnp.bfloat16 and jax.__version_info__ < (0, 12):
    pytest.skip(f"jax {jax.__version__} < 0.12 divides a bfloat16 amax by max in bfloat16")
  x = jnp.asarray(_inputs()[kind], jnp.float32).astype(dtype)
  values, scales = _jax_block_quantize()(x)
  q = _quantize(x)
  ours, theirs = np.asarray(q.values.view(jnp.uint8)), np.asarray(values.view(jnp.uint8))
  # jax 0.12.1 writes -0 (E2M1 code 8) for the +0 inputs of an all-zero block
  # (0.12.0 wrote +0, as fp4jax does): there the values must be zeros, equal as
  # numbers; every other byte bit for bit.
  zero_pairs = np.repeat(np.all(np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32) == 0,
                                axis=-1), 16, axis=-1)
  np.testing.assert_array_equal(np.where(zero_pairs, 0, ours), np.where(zero_pairs, 0, theirs))
  assert not ours[zero_pairs].any() and np.all(theirs[zero_pairs] & 0x77 == 0)
  np.testing.assert_array_equal(np.asarray(q.scales.view(jnp.uint8)),
                                np.asarray(scales.view(jnp.uint8)))


def _operands():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((1, 64, 256)) * np.exp2(rng.integers(-8, 8, (1, 64, 1)))
  b = rng.standard_t(3, (1, 48, 256))
  return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def test_rceil_gemm_matches_scaled_matmul():
  a, b = _operands()
  qa, qb = _quantize(a), _quantize(b)
  try:
    out = jax.nn.scaled_matmul(qa.values, qb.values, qa.scales, qb.scales)
  except NotImplementedError as e:
    pytest.skip(f"jax {jax.__version__} jax.nn.scaled_matmul on "
                f"{jax.default_backend()}: {str(e).splitlines()[0]}")
  want = jnp.einsum("bmk,bnk->bmn", qa.dequantize(), qb.dequantize(),
                    precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("backend", ["xla", "native"])
def test_forward_gemm_matches_jax_scaled_dot_general(backend):
  """fp4jax's fprop under rceil MXFP4 on both operands (no rotation) equals
  jax.nn.scaled_dot_general with JAX's MXFP4 config, bit for bit."""
  try:
    config = jax.nn.get_scaled_dot_general_config("mxfp4")
  except ValueError as e:
    pytest.skip(f"jax {jax.__version__} has no MXFP4 scaled_dot_general config: {e}")
  if backend == "native" and jax.__version_info__ < (0, 11):
    pytest.skip(f"backend native needs jax >= 0.11; installed jax {jax.__version__}")
  recipe = dataclasses.replace(
      recipes.recipe("bf16"), name="jax-mxfp4", fprop=recipes.Gemm(SPEC, SPEC), backend=backend)
  a, b = (x[0] for x in _operands())  # [M, K], [N, K]
  dims = (((1,), (1,)), ((), ()))
  got = jax.jit(lambda a, b: dot.dot_general(recipe)(a, b, dims,
                                                     preferred_element_type=jnp.float32))(a, b)
  want = jax.jit(lambda a, b: jax.nn.scaled_dot_general(
      a, b, dims, preferred_element_type=jnp.float32, configs=[config] * 3))(a, b)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
