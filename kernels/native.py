"""Native MXFP4 GEMMs on hardware with block-scaled matrix units.

NVIDIA GPUs of compute capability >= 10.0 (Blackwell) multiply E2M1 operands
with E8M0 block scales directly; JAX reaches them through
`jax.nn.scaled_matmul` (cuDNN). Everywhere else the GEMM is emulated by the
Pallas kernels: quantize_packed, then matmul_packed (bf16 tensor-core math on
operands dequantized in registers, float32 accumulation).

UNTESTED ON REAL HARDWARE: no Blackwell GPU was available to this project.
The CPU tests check the detection, the fallback, and that the native branch
lowers for CUDA to XLA's block-scaled dot (`__op$block_scaled_dot`) with
E2M1 values and E8M0 scales. Open question for the first Blackwell run: JAX's
docstring lists cuDNN support for MXFP8 and NVFP4 only; whether MXFP4 (E2M1
with E8M0 scales, block 32) runs on the FP4 units or is expanded by XLA into
dequantize + dot is unverified.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from fp4jax import formats
from fp4jax.kernels import gemm, quantize

MIN_CAPABILITY = (10, 0)


def unsupported_reason(device=None):
  """Why `device` (default: the first device) cannot run native MXFP4, or None."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "gpu":
    return f"platform is {device.platform!r}, not an NVIDIA GPU"
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return f"{device.device_kind} reports no compute capability (not CUDA)"
  major, minor = (int(part) for part in str(capability).split(".")[:2])
  if (major, minor) < MIN_CAPABILITY:
    return (f"{device.device_kind} has compute capability {capability} < "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: no block-scaled FP4 units")
  return None


@functools.cache
def available():
  """True when the first device runs MXFP4 GEMMs natively; logs the decision once."""
  reason = unsupported_reason()
  if reason is None:
    logging.info("fp4jax: native MXFP4 GEMMs via jax.nn.scaled_matmul "
                 "(untested on real hardware)")
    return True
  logging.info("fp4jax: MXFP4 GEMMs are emulated in bf16: %s", reason)
  return False


def _check_mxfp4(spec):
  if spec.fmt != "mxfp4" or spec.block != 32 or spec.is_random:
    raise ValueError(f"native GEMMs take MXFP4 operands with block 32 and nearest "
                     f"rounding, got {spec}")


def scaled_matmul(lhs_q, rhs_q, preferred_element_type=jnp.float32):
  """Native GEMM of QArrays quantized along their last axis: [M,K] x [N,K] -> [M,N]."""
  lhs_scales, rhs_scales = lhs_q.scales[None], rhs_q.scales[None]
  out_1xMxN = jax.nn.scaled_matmul(
      lhs_q.values[None], rhs_q.values[None], lhs_scales, rhs_scales,
      preferred_element_type=preferred_element_type)
  return out_1xMxN[0]


def mxfp4_matmul(lhs_MxK, rhs_NxK, lhs_spec, rhs_spec, *, native=None,
                 preferred_element_type=jnp.float32):
  """Quantize both operands along K (MXFP4) and multiply: -> [M, N].

  native=None uses the hardware path when `available()`, else the Pallas
  emulation (interpreted off GPUs).
  K must be a multiple of 32 (cuDNN's block size).
  """
  _check_mxfp4(lhs_spec)
  _check_mxfp4(rhs_spec)
  if lhs_MxK.shape[-1] % 32 or lhs_MxK.shape[-1] != rhs_NxK.shape[-1]:
    raise ValueError(f"K must match and be a multiple of 32, got shapes "
                     f"{lhs_MxK.shape} and {rhs_NxK.shape}")
  use_native = available() if native is None else native
  if use_native:
    lhs_q = formats.quantize(lhs_MxK, lhs_spec, axis=-1)
    rhs_q = formats.quantize(rhs_NxK, rhs_spec, axis=-1)
    return scaled_matmul(lhs_q, rhs_q, preferred_element_type)
  lhs = quantize.quantize_packed(lhs_MxK, lhs_spec, -1)
  rhs = quantize.quantize_packed(rhs_NxK, rhs_spec, -1)
  return gemm.matmul_packed(*lhs, *rhs, out_dtype=preferred_element_type)
