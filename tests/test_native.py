"""fp4jax.kernels.native: capability detection, fallback, and the CUDA lowering."""

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import formats
from fp4jax.kernels import native

MXFP4 = formats.QuantSpec("mxfp4")


def _device(platform, kind, capability=None):
  fields = dict(platform=platform, device_kind=kind)
  if capability is not None:
    fields["compute_capability"] = capability
  return types.SimpleNamespace(**fields)


@pytest.mark.parametrize("device,supported,words", [
    (_device("cpu", "cpu"), False, "not an NVIDIA GPU"),
    (_device("gpu", "NVIDIA H200", "9.0"), False, "9.0 < 10.0"),
    (_device("gpu", "AMD Instinct MI355X"), False, "no compute capability"),
    (_device("gpu", "NVIDIA B200", "10.0"), True, None),
    (_device("gpu", "NVIDIA GB300", "10.3"), True, None),
    (_device("gpu", "NVIDIA RTX PRO 6000", "12.0"), True, None),
])
def test_unsupported_reason(device, supported, words):
  reason = native.unsupported_reason(device)
  assert (reason is None) == supported
  if words:
    assert words in reason


def test_available_logs_the_fallback_reason(caplog):
  native.available.cache_clear()
  with caplog.at_level(logging.INFO):
    assert native.available() == (native.unsupported_reason() is None)
  assert "MXFP4 GEMMs are emulated" in caplog.text
  native.available.cache_clear()


def test_fallback_is_the_packed_pallas_gemm():
  """quantize_packed + matmul_packed == dequantize-then-dot (f32 accumulation).

  K = 224: seven 32-wide K slabs; M, N below one 64 tile; a NaN block.
  """
  lhs = jax.random.normal(jax.random.key(0), (40, 224)).at[3, 100].set(jnp.nan)
  rhs = jax.random.normal(jax.random.key(1), (24, 224)) * 1e3
  got = native.mxfp4_matmul(lhs, rhs, MXFP4, MXFP4, native=False)
  want = jax.jit(lambda a, b: jnp.einsum(
      "mk,nk->mn", formats.fake_quantize(a, MXFP4, -1).astype(jnp.bfloat16),
      formats.fake_quantize(b, MXFP4, -1).astype(jnp.bfloat16),
      preferred_element_type=jnp.float32))(lhs, rhs)
  assert got.shape == (40, 24) and got.dtype == jnp.float32
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert np.isnan(got[3]).all() and not np.isnan(got[:3]).any()
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_native_branch_lowers_to_cudnn_block_scaled_dot():
  lhs = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
  fn = lambda a, b: native.mxfp4_matmul(a, b, MXFP4, MXFP4, native=True)
  text = jax.jit(fn).trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
  call = [l for l in text.splitlines() if "block_scaled_dot" in l]
  assert len(call) == 1
  assert "tensor<1x128x64xf4E2M1FN>" in call[0]
  assert "tensor<1x256x2xf8E8M0FNU>" in call[0]


def test_rejects_other_formats_and_ragged_k():
  x = jnp.ones((4, 64))
  for other in (formats.QuantSpec("nvfp4"), formats.QuantSpec("mxfp4", rounding="stochastic")):
    with pytest.raises(ValueError, match="MXFP4 operands with block 32"):
      native.mxfp4_matmul(x, x, MXFP4, other)
  with pytest.raises(ValueError, match="multiple of 32"):
    native.mxfp4_matmul(jnp.ones((4, 48)), jnp.ones((4, 48)), MXFP4, MXFP4)
