"""The Hopper backend: each GEMM on FP8 tensor cores, one wgmma per 32-element block.

Operands are rotated as in the xla backend and quantized along the GEMM's
contraction axis: MX blocks of 32 by fp4jax.kernels.quantize.quantize_fp8 (one
Pallas pass that rotates, quantizes and writes the FP8 elements and float32
scales with the contraction axis last, transposing a column tile in the
kernel), everything else to a QArray (fp4jax.numerics.formats.quantize),
with the same values; the GEMM is
fp4jax.kernels.hopper_gemm (Pallas Mosaic GPU), which reads both operands
K-major as [rows, K] FP8 arrays:
- MX (block 32) and NVFP4 elements as float8_e4m3fn values (E2M1, E2M3, E3M2 and
  E4M3 are all E4M3 values; E5M2 stays float8_e5m2), their block scales as float32
  (2^e for E8M0, the E4M3 value for NVFP4) multiplying each block's partial product
  in the kernel. Blocks of 16 (NVFP4, MX with block_size=16) are zero-padded to 32
  along K, one block per wgmma: exact, at twice the tensor-core work.
- per-tensor FP8 (the fp8 recipes): the FP8 values as they are, no block
  scales; both tensor scales multiply the float32 output.
NVFP4's global scales and stochastic_dither's 4/3 multiply the float32 output, as
in every backend. For the QArray path the layout change to [rows, K] of an
operand blocked along its leading axis is left to XLA.

Exactness (the kernel's docstring): for E2M1 operands (MXFP4, NVFP4) the result is
the sum of exact block partials in increasing K order, one float32 rounding per
block, so it equals the xla backend's emulation bit for bit when K is one block
and to float32 summation order otherwise; FP8 elements are multiplied exactly
but a block's sum is rounded in float32 (as the xla emulation's is, in its own order).

Takes every GEMM whose two operands are both per-tensor FP8, or both MX / NVFP4
with the same block (16 or 32) of 1D amax-scaled blocks. Others (an unquantized
operand, 2D weight tiles such as NVFP4's, QuEST or Four over Six scales) run on
xla (fp4jax.backends.for_gemm). On a CPU the same program runs the kernel's
jnp reference (fp4jax.kernels.hopper_gemm.reference, bit for bit the kernel's
sums); on CUDA the compiled kernel. Needs jax >= 0.11; `auto` picks it on jax >= 0.12 (fp4jax.backends.MIN_JAX, AUTO_MIN_JAX).

`unsupported_device()` says why a device is not a Hopper GPU (what backend
"auto" asks before it picks this backend).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp4jax import shard_local
from fp4jax.backends import apply_factors, cuda_capability
from fp4jax.kernels import hopper_gemm
from fp4jax.numerics import formats
from fp4jax.numerics import operand
from fp4jax.numerics import scales as scales_lib

CAPABILITY_MAJOR = 9  # Hopper: FP8 wgmma
BLOCKS = (16, 32)
# fp4jax.backends: per-tensor FP8 operands are quantized before their layout changes.
QUANTIZES_WHOLE_TENSOR_FIRST = True
# fp4jax.backends: the quantize kernel and the GEMM are custom calls; fp4jax.shard_local
# runs them per shard (its matmul takes a shard_local.Plan: SHARD_LOCAL_MATMUL).
PARTITIONED_BY_XLA = False
SHARD_LOCAL_MATMUL = True


class Operand(NamedTuple):
  """values: FP8 elements (blocked operands: their axis padded to whole 32-blocks);
  scales: float32 block scales, values' shape with that axis / 32, or None
  (per-tensor); factor: float32 scalar for the GEMM's output, or None; k_last:
  the blocked axis was moved last (the other axes in order), as
  fp4jax.kernels.quantize.quantize_fp8 writes it."""
  values: jax.Array
  scales: jax.Array | None
  factor: jax.Array | None
  k_last: bool = False


def unsupported_device(device=None):
  """Why `device` (default: the first device) is not a Hopper GPU, or None."""
  device = jax.devices()[0] if device is None else device
  capability = cuda_capability(device)
  if isinstance(capability, str):
    return capability
  if capability[0] != CAPABILITY_MAJOR:
    return f"{device.device_kind} has compute capability {device.compute_capability}, not 9.x (Hopper)"
  return None


def unsupported(gemm):
  """Why this backend cannot run `gemm` (a recipes.Gemm), or None."""
  specs = (gemm.lhs, gemm.rhs)
  for side, spec in zip(("lhs", "rhs"), specs):
    if spec is None:
      return f"its {side} is not quantized"
    if spec.block is not None and not spec.is_plain_blocks:
      return (f"its {side} has block_2d={spec.block_2d}, block_scale={spec.block_scale!r} "
              "(mosaic takes 1D amax-scaled blocks)")
    if spec.block not in (None,) + BLOCKS:
      return f"its {side} has blocks of {spec.block} (mosaic takes {BLOCKS})"
  if gemm.lhs.block != gemm.rhs.block:
    return f"its operands have different blocks ({gemm.lhs.block}, {gemm.rhs.block})"
  return None


def quantize(x, spec, rotation, signs, axis, key, compute_dtype, layout=None):
  """See fp4jax.backends; returns an Operand blocked along `axis`: for MX blocks of
  32 that the Pallas kernels take, rotated and quantized in one pass that writes
  the elements [..., K] (fp4jax.kernels.quantize.quantize_fp8, bit for bit the
  jnp path's values), per shard of x's shard_local.Layout `layout` (None: on x
  as it is); otherwise through the jnp path."""
  from fp4jax.kernels import quantize as kernel_quantize  # pylint: disable=g-import-not-at-top
  h = None if rotation is None else rotation.block
  if (spec.family == "mx" and spec.block == hopper_gemm.BLOCK and spec.is_plain_blocks
      and kernel_quantize.unsupported(spec, h) is None):
    x = operand.pad_axis(x, axis, h or 1)
    if layout is None:
      values, scales = kernel_quantize.quantize_fp8(x, spec, axis, hadamard_block=h,
                                                    signs=signs, key=key)
      return Operand(values, scales, None, k_last=True)
    # The whole array's random bits, drawn as quantize_fp8(key=key) draws them.
    bits = (kernel_quantize.reference_bits(key, x.shape, axis, spec.block)
            if key is not None and spec.is_random else None)
    call = lambda x, bits, signs: kernel_quantize.quantize_fp8(
        x, spec, axis, hadamard_block=h, signs=signs, random_bits=bits)
    k_last = layout.spec[:axis] + layout.spec[axis + 1:] + (layout.spec[axis],)
    values, scales = shard_local.each_shard(call, (x, bits, signs),
                                            (layout.spec, layout.spec, None),
                                            [k_last, k_last], layout.mesh)
    return Operand(values, scales, None, k_last=True)
  x = operand.rotate_padded(x, rotation, signs, axis)
  if spec.block is not None:
    x = operand.pad_axis(x, axis, spec.block)
  return from_qarray(formats.quantize(x, spec, axis, key), x.dtype, compute_dtype)


def from_qarray(q, dtype, compute_dtype):
  """See fp4jax.backends; the Operand of a QArray (its axis zero-padded to whole blocks)."""
  del dtype, compute_dtype  # the GEMM reads the elements as they are
  values = q.values if q.values.dtype == jnp.float8_e5m2 else q.values.astype(
      jnp.float8_e4m3fn)
  if q.spec.block is None:
    return Operand(values, None, q.scales)
  block = q.spec.block
  values = operand.pad_axis(values, q.axis, block)
  if block < hopper_gemm.BLOCK:  # one block per 32-wide wgmma: the rest zeros
    shape = values.shape
    split = shape[:q.axis] + (shape[q.axis] // block, block) + shape[q.axis + 1:]
    widths = [(0, 0)] * len(split)
    widths[q.axis + 1] = (0, hopper_gemm.BLOCK - block)
    values = jnp.pad(values.reshape(split), widths).reshape(
        shape[:q.axis] + (-1,) + shape[q.axis + 1:])
  if q.spec.family == "mx":
    scales = scales_lib.exp2(scales_lib.from_e8m0(q.scales))
  else:
    scales = q.scales.astype(jnp.float32)
  return Operand(values, scales, q.global_scale)


def matmul(a, b, dims, precision, out_sharding, route=None, plan=None):
  """lax.dot_general(a, b, dims)'s float32 result through hopper_gemm.matmul
  (`precision` and `route` are other backends'). plan: a shard_local.Plan whose
  a and b are the Layouts of a's and b's axes (as `dims` reads them): the GEMM
  runs per shard, its partial products summed over plan.reduce (psum, or
  psum_scatter where plan.scatter says), before the operands' factors."""
  del precision, route
  return run(a, b, dims, out_sharding, plan, gemm)


def run(a, b, dims, out_sharding, plan, gemm_fn):
  """`matmul` with gemm_fn(values_a, values_b, scales_a, scales_b) -> float32 [B, M, N]
  (`gemm`'s arguments) as the GEMM: what this backend and mosaic_fast share."""
  product = lambda a, b: _product(a, b, dims, gemm_fn)
  if plan is None:
    y = product(a, b)
  else:
    def local(av, asc, bv, bsc):
      y = product(a._replace(values=av, scales=asc), b._replace(values=bv, scales=bsc))
      return plan.sum_partials(y)

    (ca, cb), _ = dims
    specs = [_values_spec(a, plan.a.spec, ca), _values_spec(b, plan.b.spec, cb)]
    y = shard_local.each_shard(local, (a.values, a.scales, b.values, b.scales),
                               (specs[0], specs[0], specs[1], specs[1]), plan.out,
                               plan.a.mesh)
  if out_sharding is not None:
    y = jax.sharding.reshard(y, out_sharding)
  return apply_factors(y, a.factor, b.factor)


def _values_spec(op, spec, contract):
  """The Spec of an Operand's values (and scales) from the Spec of its axes."""
  if not op.k_last:
    return spec
  (axis,) = contract
  return spec[:axis] + spec[axis + 1:] + (spec[axis],)


def gemm(av, bv, asc, bsc, block=hopper_gemm.BLOCK):
  """hopper_gemm.matmul (one promotion per `block` of K) of [B, rows, K] values and
  [B, K / block, rows] scales (or None): float32 [B, M, N]."""
  args = (av, bv) if asc is None else (av, bv, asc, bsc)
  call = functools.partial(hopper_gemm.matmul, block=block)
  if av.shape[0] == 1:
    return call(*(t[0] for t in args))[None]
  return jax.vmap(call)(*args)


def _product(a, b, dims, gemm_fn):
  """gemm_fn's float32 dot_general(a, b, dims), without the factors."""
  (ca, cb), (ba, bb) = dims
  av, asc, a_shape = _batch_rows_k(a, ca, ba)
  bv, bsc, b_shape = _batch_rows_k(b, cb, bb)
  y = gemm_fn(av, bv, asc, bsc)
  return y.reshape(a_shape + b_shape[len(bb):])  # dot_general's layout


def _batch_rows_k(op, contract, batch):
  """An Operand's values as [B, rows, K] and its scales as [B, K / 32, rows] (or
  None): batch dims first, then the free dims in order; also their shape."""
  (axis,) = contract
  ndim = op.values.ndim
  free = [d for d in range(ndim) if d != axis and d not in batch]
  if op.k_last:  # where each dim of the operand sits in values
    at = {d: i for i, d in enumerate(d for d in range(ndim) if d != axis)} | {axis: ndim - 1}
  else:
    at = {d: d for d in range(ndim)}
  perm = [at[d] for d in list(batch) + free + [axis]]
  values = jnp.transpose(op.values, perm)
  shape = values.shape[:-1]
  n_batch, rows = math.prod(shape[:len(batch)]), math.prod(shape[len(batch):])
  # Per-tensor FP8 is not padded by quantize; the kernel takes whole 32-wide steps.
  values = operand.pad_axis(values.reshape(n_batch, rows, values.shape[-1]), 2,
                            hopper_gemm.BLOCK)
  if op.scales is None:
    return values, None, shape
  scales = jnp.transpose(op.scales, perm).reshape(n_batch, rows, -1)
  return values, jnp.swapaxes(scales, 1, 2), shape
