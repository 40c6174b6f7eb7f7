"""Pallas calls whose interpret mode follows the lowering target, and arrays cut
into whole tiles for them.

A kernel called with interpret=None is traced both ways, and the lowering
keeps one: compiled (Triton) when the program is lowered for a CUDA or ROCm
GPU, interpreted (plain jnp ops) for every other platform. The choice is made
at lowering time (`lax.platform_dependent`), not by the default device, so a program
compiled for a GPU on a machine without one (`python -m fp4jax.bench
gpu_compile`) holds the compiled kernel, and the same jitted function runs
interpreted on the CPU.
"""

from jax import lax
from jax.experimental import pallas as pl

GPU_PLATFORMS = ("cuda", "rocm")


def pallas_call(kernel, *, interpret=None, **kwargs):
  """pl.pallas_call(kernel, interpret=..., **kwargs), with interpret=None meaning
  compiled for GPU targets and interpreted elsewhere (module docstring)."""
  if interpret is not None:
    return pl.pallas_call(kernel, interpret=interpret, **kwargs)
  compiled = pl.pallas_call(kernel, interpret=False, **kwargs)
  interpreted = pl.pallas_call(kernel, interpret=True, **kwargs)
  return lambda *operands: lax.platform_dependent(
      *operands, default=interpreted, **{p: compiled for p in GPU_PLATFORMS})


# Triton's loads and stores are not masked at an array's edge: a kernel must read
# and write whole tiles (fp4jax.kernels.quantize says what a partial one did); the
# kernels zero-pad with fp4jax.numerics.operand.pad_axis and cut outputs with cut_to.
def whole_tiles(length, tile):
  """length rounded up to a whole number of tiles."""
  return -(-length // tile) * tile


def cut_to(a, shape):
  """The leading `shape` corner of a (a itself where it has that shape)."""
  if a.shape == tuple(shape):
    return a
  return a[tuple(slice(0, s) for s in shape)]
