"""2D block scaling: one scale per square tile of block x block elements.

NVIDIA's NVFP4 recipe ("Pretraining LLMs with NVFP4", arXiv 2509.25149)
scales weights in 16x16 tiles, so that the weight quantized for Fprop
(blocks along K) is the same quantized weight Dgrad needs (blocks along N):
a tile covers both directions, so quantize(W).T == quantize(W.T). For MX
formats the tile is 32x32 (AMD's ALTO uses 32x32 MXFP4 weight blocks).

A tensor is viewed as a matrix [quantized axis, all other axes flattened in
order], zero-padded to multiples of the tile, and each tile becomes one block
of block*block elements for fp4jax.numerics.formats: its scale comes from the tile's
amax (NVFP4's per-tensor scale from the whole tensor), its elements round as
in 1D. Padding zeros change no amax. Stochastic rounding draws its bits per
tile element in the tile's row-major order, so it is the one part that is not
transpose-symmetric.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp4jax.numerics import formats
from fp4jax.numerics import tiles as tiles_lib


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


def _check(x2, spec):
  if not isinstance(spec, formats.QuantSpec) or spec.block is None:
    raise ValueError(f"2D tiles need a blocked QuantSpec, got {spec!r}")
  if jnp.ndim(x2) != 2:
    raise ValueError(f"quantize_tiles takes a matrix, got shape {jnp.shape(x2)}")


def quantize_tiles(x2, spec: formats.QuantSpec, key=None) -> TiledQArray:
  """Quantizes the matrix x2 [R, C] in spec.block x spec.block tiles."""
  _check(x2, spec)
  t = spec.block
  q = formats.quantize(tiles_lib.to_tiles(jnp.asarray(x2), t), tiles_lib.tile_spec(spec), -1, key)
  return TiledQArray(tiles_lib.from_tiles(q.values, x2.shape, t), q.scales[..., 0], q.global_scale,
                     spec)


def dequantize_tiles(q: TiledQArray, dtype=jnp.float32):
  """(values * tile scale) * global_scale as `dtype`, shape q.values.shape."""
  t = q.spec.block
  tiles = formats.QArray(tiles_lib.to_tiles(q.values, t), q.scales[..., None], q.global_scale,
                         tiles_lib.tile_spec(q.spec), 2)
  return tiles_lib.from_tiles(tiles.dequantize(dtype), q.values.shape, t)
