"""The Pallas backend: fp4jax.kernels' fused rotate + MX fake quantize, the xla GEMM.

An operand whose spec the kernels take (MX 1D amax-scaled blocks, power-of-two
block, nearest or stochastic rounding) is rotated and quantized in one kernel pass (compiled
with Triton on GPUs, interpreted elsewhere), bit for bit the xla backend's
values; any other operand goes through the xla backend. Operands and the
GEMM are the xla backend's.
"""

from fp4jax import shard_local
from fp4jax.backends import xla
from fp4jax.numerics import operand

# This backend's from_qarray, matmul and unsupported (fp4jax.backends) are the xla backend's.
from_qarray = xla.from_qarray
matmul = xla.matmul
unsupported = xla.unsupported
# fp4jax.backends: per-tensor operands never reach a kernel (they take xla.quantize),
# so they follow xla's rule and are quantized before their layout changes.
QUANTIZES_WHOLE_TENSOR_FIRST = True
# fp4jax.backends: the quantize kernel is a custom call; fp4jax.shard_local runs it per shard.
PARTITIONED_BY_XLA = False


def quantize(x, spec, rotation, signs, axis, key, compute_dtype, layout=None):
  """See fp4jax.backends; returns an xla.Operand. layout: x's shard_local.Layout,
  or None (the kernel runs on x as it is)."""
  from fp4jax.kernels import quantize as kernel_quantize  # pylint: disable=g-import-not-at-top
  block = None if rotation is None else rotation.block
  if (spec is None or not spec.is_plain_blocks
      or kernel_quantize.unsupported(spec, block) is not None):
    return xla.quantize(x, spec, rotation, signs, axis, key, compute_dtype)
  x = operand.pad_axis(x, axis, block or 1)
  if layout is None:
    y = kernel_quantize.fake_quantize(x, spec, axis, hadamard_block=block, signs=signs, key=key)
    return xla.Operand(y.astype(compute_dtype), None)
  # The whole array's random bits, drawn as fake_quantize(key=key) draws them.
  bits = (kernel_quantize.reference_bits(key, x.shape, axis, spec.block)
          if key is not None and spec.is_random else None)
  call = lambda x, bits, signs: kernel_quantize.fake_quantize(
      x, spec, axis, hadamard_block=block, signs=signs, random_bits=bits)
  y = shard_local.each_shard(call, (x, bits, signs), (layout.spec, layout.spec, None),
                             layout.spec, layout.mesh)
  return xla.Operand(y.astype(compute_dtype), None)
