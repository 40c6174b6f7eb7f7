"""The layout of 2D block scaling: square tiles of a tensor as rows of one block each.

A tensor is viewed as a matrix [quantized axis, all other axes flattened in
order], zero-padded to multiples of the tile side t, and each t x t tile
becomes one row of t*t elements (row-major), which fp4jax.numerics.formats
quantizes as one 1D block. fp4jax.numerics.blocks2d has the quantized tiles.
"""

import dataclasses

import jax.numpy as jnp


def tile_spec(spec):
  """The 1D spec that quantizes one flattened tile as one block."""
  return dataclasses.replace(spec, block_size=spec.block * spec.block, block_2d=False)


def to_tiles(x2, t):
  """[R, C] -> [ceil(R/t), ceil(C/t), t*t], zero-padded, each tile row-major."""
  r, c = x2.shape
  x2 = jnp.pad(x2, ((0, -r % t), (0, -c % t)))
  rt, ct = x2.shape[0] // t, x2.shape[1] // t
  return x2.reshape(rt, t, ct, t).transpose(0, 2, 1, 3).reshape(rt, ct, t * t)


def from_tiles(tiles, shape, t):
  """Inverse of to_tiles, trimmed to `shape` [R, C]."""
  rt, ct, _ = tiles.shape
  x2 = tiles.reshape(rt, ct, t, t).transpose(0, 2, 1, 3).reshape(rt * t, ct * t)
  return x2[:shape[0], :shape[1]]


def tiled(x, spec, axis, quantize_tiles_fn):
  """quantize_tiles_fn([tiles, t*t] float32, tile spec) -> (y, factor), applied over
  (axis, all other axes flattened) and mapped back to x's shape."""
  x = jnp.asarray(x)
  if spec.block is None:
    raise ValueError(f"2D tiles need a blocked format, got {spec.fmt}")
  axis %= x.ndim
  xm = jnp.moveaxis(x, axis, 0)
  x2 = xm.reshape(xm.shape[0], -1)
  t = spec.block
  y, factor = quantize_tiles_fn(to_tiles(x2, t), tile_spec(spec))
  return jnp.moveaxis(from_tiles(y, x2.shape, t).reshape(xm.shape), 0, axis), factor
