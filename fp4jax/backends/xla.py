"""The reference backend: jnp fake quantization, then one GEMM in the compute dtype.

An operand, as stored, is rotated (float32 accumulation, result in its dtype)
and fake-quantized in float32 (fp4jax.numerics.operand,
fp4jax.numerics.formats), split into its block-dequantized values and its
float32 per-tensor factor (NVFP4's global scale, stochastic_dither's 4/3; None
for plain MX), and the values are cast to the recipe's compute dtype. MX and
NVFP4 values (elements times E8M0 / E4M3 block scales) are exact in bf16; the
factors are applied to the float32 GEMM output, as hardware applies them in its
epilogue. Per-tensor FP8 values carry their float32 scale (there are no block
scales) and stay in the input's dtype, as fake_quantize returns them (rounded to
it: bf16 for a bf16 model, exact in float32 for a float32 one); the GEMM runs in
the wider of its operands' dtypes, so bf16 FP8 operands take the bf16 GEMM,
whose float32 accumulation may order its sums differently from a float32 GEMM's
(the operand values are the same).

GEMM dtype: the products of two bf16 values are exact in float32, so the GEMM
of bf16 operand values may run as a float32 GEMM of the same values, and where
the bf16 GEMM also sums them in the float32 GEMM's order it gives the same
bits. On a CPU without bf16 instructions XLA:CPU's bf16 GEMM is the slower
one; there (`bf16_gemm`: the CPU's flags, then a one-time check per process
that a bf16 and a float32 dot of the same values give the same bits) the GEMMs
of bf16 values run in float32. Everywhere else, or where the bits differ,
they run in bf16.
"""

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
from jax._src import mesh as mesh_lib  # private: jax.sharding.get_mesh() refuses inside jit
from jax import lax
import jax.numpy as jnp
import numpy as np

from fp4jax import cpuinfo
from fp4jax.numerics import formats
from fp4jax.numerics.operand import rotate_padded
from fp4jax.backends import apply_factors, fence_dot_output

# fp4jax.backends: FP8 per-tensor operands are quantized before their layout changes.
QUANTIZES_WHOLE_TENSOR_FIRST = True
# fp4jax.backends: jnp only, which XLA's SPMD partitioner splits.
PARTITIONED_BY_XLA = True
# fp4jax.backends: an FP4 lhs is quantized in place, as the rhs (the GEMM contracts any axis).
LHS_IN_PLACE = True


class Operand(NamedTuple):
  """values: the rotated, block-dequantized operand (compute dtype, or float32);
  factor: float32 scalar for the GEMM's output, or None."""
  values: jax.Array
  factor: jax.Array | None


def unsupported(gemm):
  """The xla backend runs every GEMM: None."""
  del gemm


def quantize(x, spec, rotation, signs, axis, key, compute_dtype):
  """See fp4jax.backends; returns an Operand."""
  x = rotate_padded(x, rotation, signs, axis)
  if spec is None:
    return Operand(x.astype(compute_dtype), None)
  if spec.family == "fp8":
    return Operand(formats.fake_quantize(x, spec, axis, key), None)
  values, factor = formats.fake_quantize_unscaled(x, spec, axis, key)
  return Operand(values.astype(compute_dtype), factor)


def from_qarray(q, dtype, compute_dtype):
  """See fp4jax.backends; returns the Operand `quantize` gives, bit for bit."""
  if q.spec.family == "fp8":
    return Operand(q.dequantize(dtype), None)
  values = dataclasses.replace(q, global_scale=None).dequantize(jnp.float32)
  return Operand(values.astype(compute_dtype), q.global_scale)


def matmul(a, b, dims, precision, out_sharding, route=None):
  """The GEMM of the operands' values in the wider of their dtypes (`gemm_dtype`
  of it), float32 accumulation, then the operands' factors (`route` is the
  native backend's)."""
  del route
  dtype = gemm_dtype(jnp.promote_types(a.values.dtype, b.values.dtype))
  (lhs_contracting, _), _ = dims
  if (dtype == jnp.bfloat16 and traced_platform() == "cpu"
      and max(lhs_contracting) != a.values.ndim - 1):
    # A lhs quantized in place (LHS_IN_PLACE: FP4, whose float32 sums are exact in
    # any order): XLA:CPU (jax 0.10.2) runs a bf16 dot contracting the lhs's leading
    # axis as a float32 dot, or in some programs fails ("Unsupported element type
    # for DotThunk"); the float32 dot of the same values is what it runs.
    dtype = jnp.dtype(jnp.float32)
  y = lax.dot_general(a.values.astype(dtype), b.values.astype(dtype), dims, precision,
                      jnp.float32, out_sharding=out_sharding)
  return apply_factors(fence_dot_output(y, dtype), a.factor, b.factor)


class GemmDtype(NamedTuple):
  """The dtype the GEMMs of bf16 operand values run in ("bfloat16" or "float32"), and why."""
  dtype: str
  why: str


def traced_platform() -> str:
  """The platform a program is being traced for: that of the devices of the
  mesh jax.set_mesh made current (a GPU program compiled on a machine without
  a GPU, by fp4jax.bench, sets its compile-only GPUs), else the default
  device's."""
  mesh = mesh_lib.get_concrete_mesh()
  if mesh is None or mesh.empty:
    return jax.default_backend()
  return mesh.devices.flat[0].platform


def gemm_dtype(dtype):
  """The dtype a GEMM of `dtype` operand values runs in: bf16_gemm()'s for
  bfloat16 on the CPU, `dtype` itself otherwise."""
  if jnp.dtype(dtype) == jnp.bfloat16 and traced_platform() == "cpu":
    return jnp.dtype(bf16_gemm().dtype)
  return jnp.dtype(dtype)


@functools.cache
def bf16_gemm() -> GemmDtype:
  """choose_bf16_gemm for this process's default device and CPU, decided once."""
  return choose_bf16_gemm(jax.default_backend(), cpuinfo.host_flags(),
                          bf16_dot_gives_float32_bits)


def choose_bf16_gemm(platform: str, cpu_flags, same_bits: Callable[[], bool]) -> GemmDtype:
  """float32 on a CPU (`platform` "cpu") whose `cpu_flags` (cpuinfo.flags) hold
  no bf16 instructions, where its bf16 GEMM is slower, and where `same_bits()`
  (asked only then) says a float32 GEMM gives the bf16 GEMM's bits; bfloat16
  otherwise."""
  if platform != "cpu":
    return GemmDtype("bfloat16", f"{platform}: bf16 GEMMs")
  have = cpuinfo.bf16_flags(cpu_flags)
  if have:
    return GemmDtype("bfloat16", f"CPU with bf16 instructions ({' '.join(have)})")
  if not same_bits():
    return GemmDtype("bfloat16", "CPU without bf16 instructions, whose bf16 GEMM sums in "
                     "another order than its float32 GEMM")
  return GemmDtype("float32", "CPU without bf16 instructions, whose bf16 GEMM gives the "
                   "float32 GEMM's bits")


# M x K x N of the dots bf16_dot_gives_float32_bits compares: a square one and a
# long contraction, as fp4jax's Wgrad has.
_PROBE_SHAPES = ((256, 1024, 256), (64, 4096, 48))


def _float32_output_dot(dtype):
  """jit(x, w -> X W with float32 accumulation and output, on `dtype` casts)."""
  return jax.jit(lambda x, w: lax.dot_general(x.astype(dtype), w.astype(dtype),
                                              (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32))


def bf16_dot_gives_float32_bits(shapes=_PROBE_SHAPES) -> bool:
  """True when this process's default device computes the float32-output dot of
  Gaussian bf16 X[M, K] and W[K, N] bit for bit as the float32 dot of their
  float32 casts, for every M x K x N of `shapes` (sums of such products round
  in most orders, so another order of summation shows)."""
  rng = np.random.default_rng(0)
  with jax.ensure_compile_time_eval():  # runs now, also while a caller traces
    for m, k, n in shapes:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
      y16, y32 = (np.asarray(_float32_output_dot(t)(x, w)) for t in (jnp.bfloat16, jnp.float32))
      if not np.array_equal(y16.view(np.uint32), y32.view(np.uint32)):
        return False
  return True
