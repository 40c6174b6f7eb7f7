"""fp4jax's rceil MXFP4 against JAX's own block-scaled quantizer and GEMM.

JAX (0.10) quantizes for `jax.nn.scaled_dot_general` in
jax._src.cudnn.scaled_matmul_stablehlo.quantize: scale = amax / max rounded up
to a power of two (rceil), elements cast with astype. `jax.nn.scaled_matmul`
itself has a lowering for GPUs only; elsewhere that test is skipped with the
error JAX gives.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import formats

SPEC = formats.QuantSpec("mxfp4", scale_mode="rceil")
_quantize = jax.jit(lambda x: formats.quantize(x, SPEC))


def _jax_block_quantize():
  try:
    sm = importlib.import_module("jax._src.cudnn.scaled_matmul_stablehlo")
  except ImportError as e:
    pytest.skip(f"JAX's block-scale quantizer is not importable: {e}")
  config = sm.BlockScaleConfig(
      mode="mxfp8", block_size=32, data_type=jnp.float4_e2m1fn,
      scale_type=jnp.float8_e8m0fnu, global_scale=None, infer_only=False)
  return jax.jit(lambda x: sm.quantize(x, config))


def _operands():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((1, 64, 256)) * np.exp2(
      rng.integers(-8, 8, (1, 64, 1)))
  b = rng.standard_t(3, (1, 48, 256))
  return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def test_rceil_matches_jax_block_quantizer():
  jq = _jax_block_quantize()
  for x in _operands():
    values, scales = jq(x)
    q = _quantize(x)
    np.testing.assert_array_equal(np.asarray(q.values, np.float32),
                                  np.asarray(values, np.float32))
    np.testing.assert_array_equal(np.asarray(q.scales.view(jnp.uint8)),
                                  np.asarray(scales.view(jnp.uint8)))


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
