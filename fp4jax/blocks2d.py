"""2D block scaling: one scale per square tile of block x block elements.

NVIDIA's NVFP4 recipe ("Pretraining LLMs with NVFP4", arXiv 2509.25149)
scales weights in 16x16 tiles, so that the weight quantized for Fprop
(blocks along K) is the same quantized weight Dgrad needs (blocks along N):
a tile covers both directions, so quantize(W).T == quantize(W.T). For MX
formats the tile is 32x32 (AMD's ALTO uses 32x32 MXFP4 weight blocks).

A tensor is viewed as a matrix [quantized axis, all other axes flattened in
order], zero-padded to multiples of the tile, and each tile becomes one block
of block*block elements for fp4jax.formats: its scale comes from the tile's
amax (NVFP4's per-tensor scale from the whole tensor), its elements round as
in 1D. Padding zeros change no amax. Stochastic rounding draws its bits per
tile element in the tile's row-major order, so it is the one part that is not
transpose-symmetric.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp4jax import formats


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "scales", "global_scale"], meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class TiledQArray:
  """A matrix quantized in square tiles.

  values: [R, C] spec.element_dtype. scales: [ceil(R/t), ceil(C/t)]
  spec.scale_dtype. global_scale: float32 scalar or None (as QArray).
  """
  values: jax.Array
  scales: jax.Array
  global_scale: jax.Array | None
  spec: formats.QuantSpec


def _tile_spec(spec):
  """The 1D spec that quantizes one flattened tile as one block."""
  return dataclasses.replace(spec, block_size=spec.block * spec.block, block_2d=False)


def _to_tiles(x2, t):
  """[R, C] -> [ceil(R/t), ceil(C/t), t*t], zero-padded, each tile row-major."""
  r, c = x2.shape
  x2 = jnp.pad(x2, ((0, -r % t), (0, -c % t)))
  rt, ct = x2.shape[0] // t, x2.shape[1] // t
  return x2.reshape(rt, t, ct, t).transpose(0, 2, 1, 3).reshape(rt, ct, t * t)


def _from_tiles(tiles, shape, t):
  """Inverse of _to_tiles, trimmed to `shape` [R, C]."""
  rt, ct, _ = tiles.shape
  x2 = tiles.reshape(rt, ct, t, t).transpose(0, 2, 1, 3).reshape(rt * t, ct * t)
  return x2[:shape[0], :shape[1]]


def _check(x2, spec):
  if not isinstance(spec, formats.QuantSpec) or spec.block is None:
    raise ValueError(f"2D tiles need a blocked QuantSpec, got {spec!r}")
  if jnp.ndim(x2) != 2:
    raise ValueError(f"quantize_tiles takes a matrix, got shape {jnp.shape(x2)}")


def quantize_tiles(x2, spec: formats.QuantSpec, key=None) -> TiledQArray:
  """Quantizes the matrix x2 [R, C] in spec.block x spec.block tiles."""
  _check(x2, spec)
  t = spec.block
  q = formats.quantize(_to_tiles(jnp.asarray(x2), t), _tile_spec(spec), -1, key)
  return TiledQArray(_from_tiles(q.values, x2.shape, t), q.scales[..., 0], q.global_scale,
                     spec)


def dequantize_tiles(q: TiledQArray, dtype=jnp.float32):
  """(values * tile scale) * global_scale as `dtype`, shape q.values.shape."""
  t = q.spec.block
  tiles = formats.QArray(_to_tiles(q.values, t), q.scales[..., None], q.global_scale,
                         _tile_spec(q.spec), 2)
  return _from_tiles(tiles.dequantize(dtype), q.values.shape, t)


def _tiled(x, spec, axis, quantize_tiles_fn):
  """quantize_tiles_fn([tiles, t*t] float32, tile spec) -> (y, factor), applied over
  (axis, all other axes flattened) and mapped back to x's shape."""
  x = jnp.asarray(x)
  if spec.block is None:
    raise ValueError(f"2D tiles need a blocked format, got {spec.fmt}")
  axis %= x.ndim
  xm = jnp.moveaxis(x, axis, 0)
  x2 = xm.reshape(xm.shape[0], -1)
  t = spec.block
  y, factor = quantize_tiles_fn(_to_tiles(x2, t), _tile_spec(spec))
  return jnp.moveaxis(_from_tiles(y, x2.shape, t).reshape(xm.shape), 0, axis), factor


def fake_quantize_2d(x, spec: formats.QuantSpec, axis: int = -1, key=None):
  """x quantized in tiles over (axis, all other axes flattened) and dequantized,
  in x's shape and dtype; straight-through gradient."""
  return _tiled(x, spec, axis,
                lambda tiles, s: (formats.fake_quantize(tiles, s, -1, key), None))[0]


def fake_quantize_2d_unscaled(x, spec: formats.QuantSpec, axis: int = -1, key=None):
  """formats.fake_quantize_unscaled for tiles: (float32 values without the
  per-tensor factor, x's shape; global_scale float32 scalar or None)."""
  return _tiled(x, spec, axis,
                lambda tiles, s: formats.fake_quantize_unscaled(tiles, s, -1, key))
