"""Fused MX quantization as Pallas kernels.

One kernel body, three outputs:
  quantize_packed  x -> (uint8 codes, two E2M1 per byte, low nibble first;
                         E8M0 scales)                       (MXFP4 only)
  fake_quantize    x -> dequantized x, same shape and dtype (any MX format)
  quantize_fp8     x -> (FP8 elements, float32 scales), the blocked axis last
                         (any MX format; the `mosaic` backend's operands)

Each program reads one tile of x, optionally rotates it with the block
Hadamard of fp4jax.numerics.hadamard, takes the block amax, the shared exponent
(fp4jax.numerics.scales.block_exponent, all four scale modes) and rounds with
fp4jax.numerics.formats.round_to_element (nearest, or stochastic from supplied uint32
bits). The results equal the XLA reference bit for bit:

  quantize_packed(x, ...) == (pack_fp4(q.values, axis), q.scales)
  fake_quantize(x, ...)   == formats.fake_quantize(rotate(x, h, axis, signs), spec, axis)
  with q = formats.quantize(rotate(x, h, axis, signs), spec, axis).

Layouts: x is viewed as [P, N, Q] with N the blocked axis (a free reshape).
Q == 1 (blocks along the last axis, "row-wise") tiles [P, N] by ROW_TILE;
otherwise ("column-wise", e.g. Wgrad's token axis) the kernel reads
[tile_n, tile_q] column tiles of [P, N, Q] and blocks along the tile's first
axis, so no transposed copy is ever made. Tiles are powers of two (as Triton
needs), and every kernel reads and writes whole tiles: Triton's loads and
stores are not masked at an array's edge (a tile wider than the array wrote
its zero padding over the next row's codes on an H200), so a view that is not
a whole number of tiles is zero-padded first (the reference's own padding
along N) and the outputs are cut back; shapes that tile exactly are not copied.

interpret=None runs compiled (Triton) where the program is lowered for a GPU
and interpreted elsewhere (fp4jax.kernels.target); True / False force one.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax.kernels import target
from fp4jax.numerics import elements
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.numerics import operand
from fp4jax.numerics import scales as scales_lib

ROW_TILE = (16, 512)  # [rows, blocked elements] for blocks along the last axis
COL_TILE = (64, 128)  # [blocked elements, columns] for blocks along a leading axis


def _pow2_at_least(n):
  return 1 << max(n - 1, 0).bit_length()


def _rotate_tile(x, m, h, blk_axis):
  """hadamard.rotate of a 2-D tile along blk_axis by the [h, h] matrix m.

  Written as one 2-D dot (what Triton lowers) with float32 accumulation, with
  hadamard.rotate's operand dtype (hadamard.matmul_dtype), precision and cast
  back to x's dtype.
  """
  mdt = hadamard.matmul_dtype(x.dtype, h)
  xf, m = x.astype(mdt), m.astype(mdt)
  dot = functools.partial(jnp.dot, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  if blk_axis == 1:
    y = dot(xf.reshape(-1, h), m).reshape(x.shape)
  else:  # [n, cols] -> [n / h, cols, h]: each column's h-vectors as rows
    t = xf.reshape(x.shape[0] // h, h, x.shape[1]).transpose(0, 2, 1)
    y = dot(t.reshape(-1, h), m).reshape(t.shape).transpose(0, 2, 1).reshape(x.shape)
  return y.astype(x.dtype)


def _kernel(*refs, spec, blk_axis, hadamard_block, has_bits, out):
  """One tile: [rotate] -> amax -> exponent -> round -> `out`: "fake" (x~), "packed"
  (codes, biased scales) or "fp8" (FP8 elements, float32 scales, the blocked axis
  last: a column tile is written transposed)."""
  refs = list(refs)
  x_ref = refs.pop(0)
  rotation = refs.pop(0)[...] if hadamard_block else None
  bits = refs.pop(0)[...] if has_bits else None
  x = x_ref[...]
  if hadamard_block:
    x = _rotate_tile(x, rotation, hadamard_block, blk_axis)
  block = spec.block
  shape = x.shape
  if blk_axis == 1:  # [rows, tile_n] -> [rows, tile_n / block, block]
    blocks_shape, red = (shape[0], shape[1] // block, block), 2
  else:  # [tile_n, cols] -> [tile_n / block, block, cols]
    blocks_shape, red = (shape[0] // block, block, shape[1]), 1
  xb = x.astype(jnp.float32).reshape(blocks_shape)
  amax = formats.block_amax(xb, red)  # NaN-propagating integer max (formats' own)
  e = scales_lib.block_exponent(amax, spec)
  inv = scales_lib.exp2(jnp.where(e == scales_lib.E8M0_NAN, e, -e))
  if has_bits:
    bits = bits.reshape(blocks_shape)
  scaled = xb * inv
  q = formats.round_to_element(scaled, spec, bits, elements.round_half_even_by_floor)
  # Triton's float min/max drop NaN (minnumf/maxnumf), so the rounding's saturating
  # clip would turn a NaN into +-max: keep it NaN, as XLA's min/max do.
  q = jnp.where(jnp.isnan(scaled), scaled, q)
  if out == "fake":
    (y_ref,) = refs
    y_ref[...] = (q * scales_lib.exp2(e)).reshape(shape).astype(y_ref.dtype)
    return
  if out == "fp8":
    values_ref, scales_ref = refs
    values, scale = q.reshape(shape), jnp.squeeze(scales_lib.exp2(e), red)
    if blk_axis == 0:  # [tile_n, cols] -> [cols, tile_n]: the blocked axis last
      values, scale = values.T, scale.T
    values_ref[...] = values.astype(values_ref.dtype)
    scales_ref[...] = scale
    return
  codes_ref, scales_ref = refs
  codes = elements.e2m1_codes(q).reshape(shape)
  # Pairs along the blocked axis: element 2i -> low nibble, 2i + 1 -> high.
  if blk_axis == 1:
    pairs, nibble = codes.reshape(shape[0], shape[1] // 2, 2), (1, 1, 2)
  else:
    pairs, nibble = codes.reshape(shape[0] // 2, 2, shape[1]), (1, 2, 1)
  weight = jnp.where(lax.broadcasted_iota(jnp.int32, nibble, red) == 0, 1, 16)
  codes_ref[...] = jnp.sum(pairs.astype(jnp.int32) * weight, axis=red).astype(jnp.uint8)
  scales_ref[...] = (jnp.squeeze(e, red) + 127).astype(jnp.uint8)


def unsupported(spec, hadamard_block=None):
  """Why the kernels cannot quantize with `spec` (and the rotation), or None.

  Callers route such operands to the XLA path (fp4jax.numerics.formats).
  """
  if not isinstance(spec, formats.QuantSpec) or spec.family != "mx":
    return f"Pallas kernels take MX QuantSpecs, got {spec!r}"
  if spec.block & (spec.block - 1):
    return f"Pallas kernels need a power-of-two block, got {spec.block}"
  if spec.rounding == "stochastic_dither":
    return "Pallas kernels do not implement stochastic_dither"
  if hadamard_block and hadamard_block & (hadamard_block - 1):
    return f"Hadamard block {hadamard_block} is not a power of two"
  return None


def _check(x, spec, axis, hadamard_block, random_bits):
  reason = unsupported(spec, hadamard_block)
  if reason:
    raise ValueError(reason)
  if spec.is_random != (random_bits is not None):
    raise ValueError(f"rounding={spec.rounding!r} "
                     + ("needs" if spec.is_random else "takes no") + " random_bits")
  if random_bits is not None and (random_bits.shape != x.shape
                                  or random_bits.dtype != jnp.uint32):
    raise ValueError(f"random_bits must be uint32 of shape {x.shape}, got "
                     f"{random_bits.dtype} {random_bits.shape}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} out of range for an array of rank {x.ndim}")
  axis %= x.ndim
  if hadamard_block and x.shape[axis] % hadamard_block:
    raise ValueError(f"axis {axis} has length {x.shape[axis]}, not a multiple "
                     f"of the Hadamard block {hadamard_block}")
  return axis


def _call(x, spec, axis, hadamard_block, signs, random_bits, interpret, tile, out):
  """Runs the kernel on x viewed as [P, N, Q]; returns outputs in that view (for
  out="fp8", [P, Q, N] and [P, Q, N / block])."""
  shape = x.shape
  p, n, q = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
  block = spec.block
  n_blocks = -(-n // block)
  min_tn = max(block, hadamard_block or 1)
  row = q == 1
  if row:
    tp, tn = tile or (min(ROW_TILE[0], _pow2_at_least(p)),
                      max(min_tn, min(ROW_TILE[1], _pow2_at_least(n))))
    pp, pn = target.whole_tiles(p, tp), target.whole_tiles(n, tn)
    view, padded, grid = (p, n), (pp, pn), (pp // tp, pn // tn)
    pad = lambda a: operand.pad_axis(operand.pad_axis(a, 0, tp), 1, tn)
    spec_of = lambda t: pl.BlockSpec((tp, t), lambda i, j: (i, j))
    out_view = lambda m: (pp, m)
    k_last_spec, k_last_view = spec_of, out_view
  else:
    tn, tq = tile or (max(min_tn, min(COL_TILE[0], _pow2_at_least(n))),
                      min(COL_TILE[1], _pow2_at_least(q)))
    pn, pq = target.whole_tiles(n, tn), target.whole_tiles(q, tq)
    view, padded, grid = (p, n, q), (p, pn, pq), (p, pn // tn, pq // tq)
    pad = lambda a: operand.pad_axis(operand.pad_axis(a, 1, tn), 2, tq)
    spec_of = lambda t: pl.BlockSpec((None, t, tq), lambda i, j, k: (i, j, k))
    out_view = lambda m: (p, m, pq)
    k_last_spec = lambda t: pl.BlockSpec((None, tq, t), lambda i, j, k: (i, k, j))
    k_last_view = lambda m: (p, pq, m)
  if tn % min_tn or tn & (tn - 1):
    raise ValueError(f"tile along the blocked axis must be a power of two "
                     f"multiple of {min_tn}, got {tn}")
  operands, in_specs = [pad(x.reshape(view))], [spec_of(tn)]
  if hadamard_block:
    # diag(signs) @ H (a kernel takes no constants): the rotated identity.
    eye = jnp.eye(hadamard_block, dtype=jnp.float32)
    operands.append(hadamard.rotate(eye, hadamard_block, -1, signs))
    in_specs.append(pl.BlockSpec((hadamard_block,) * 2, lambda *_: (0, 0)))
  if random_bits is not None:
    operands.append(pad(random_bits.reshape(view)))
    in_specs.append(spec_of(tn))
  if out == "packed":
    out_shape = (jax.ShapeDtypeStruct(out_view(pn // 2), jnp.uint8),
                 jax.ShapeDtypeStruct(out_view(pn // block), jnp.uint8))
    out_specs = (spec_of(tn // 2), spec_of(tn // block))
    out_views = (view[:1] + (n // 2,) + view[2:], view[:1] + (n_blocks,) + view[2:])
  elif out == "fp8":
    out_shape = (jax.ShapeDtypeStruct(k_last_view(pn), fp8_dtype(spec)),
                 jax.ShapeDtypeStruct(k_last_view(pn // block), jnp.float32))
    out_specs = (k_last_spec(tn), k_last_spec(tn // block))
    rest = view[:1] if row else view[:1] + view[2:]
    out_views = (rest + (n_blocks * block,), rest + (n_blocks,))
  else:
    out_shape, out_specs, out_views = jax.ShapeDtypeStruct(padded, x.dtype), spec_of(tn), view
  kernel = functools.partial(
      _kernel, spec=spec, blk_axis=1 if row else 0,
      hadamard_block=hadamard_block, has_bits=random_bits is not None, out=out)
  result = target.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
      out_specs=out_specs, interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      name={"packed": "fp4jax_quantize", "fake": "fp4jax_fake_quantize",
            "fp8": "fp4jax_quantize_fp8"}[out],
  )(*operands)
  if out == "fake":
    return target.cut_to(result, out_views)
  return tuple(target.cut_to(o, v) for o, v in zip(result, out_views))


_STATIC = ("spec", "axis", "hadamard_block", "interpret", "tile")


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_packed(x, spec, axis=-1, *, hadamard_block=None, signs=None,
                    random_bits=None, interpret=None, tile=None):
  """MXFP4-quantizes x along `axis` in one pass.

  x: [..., n, ...] any float dtype, n even. hadamard_block: None, 16 or 32
  (n a multiple of it); signs: None, a +-1 vector or a PRNG key, as in
  hadamard.rotate. random_bits: uint32 of x's shape for stochastic rounding.
  tile: optional (tile_rows, tile_n) row-wise or (tile_n, tile_cols)
  column-wise. Returns (codes uint8 [..., n/2, ...], scales float8_e8m0fnu
  [..., ceil(n/32), ...]).
  """
  axis = _check(x, spec, axis, hadamard_block, random_bits)
  if spec.fmt != "mxfp4":
    raise ValueError(f"quantize_packed packs MXFP4 only, got fmt={spec.fmt!r}")
  if x.shape[axis] % 2:
    raise ValueError(f"packing needs an even length along axis {axis}, got "
                     f"{x.shape[axis]}")
  codes, biased = _call(x, spec, axis, hadamard_block, signs, random_bits,
                        interpret, tile, out="packed")
  shape = lambda m: x.shape[:axis] + (m,) + x.shape[axis + 1:]
  codes = codes.reshape(shape(x.shape[axis] // 2))
  biased = biased.reshape(shape(biased.shape[1]))
  return codes, lax.bitcast_convert_type(biased, jnp.float8_e8m0fnu)


def fp8_dtype(spec):
  """The FP8 dtype quantize_fp8 writes a spec's elements in: float8_e5m2 for E5M2
  elements, float8_e4m3fn (which holds every E2M1, E2M3, E3M2 and E4M3 value) else."""
  return jnp.float8_e5m2 if spec.element_dtype == jnp.float8_e5m2 else jnp.float8_e4m3fn


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_fp8(x, spec, axis=-1, *, hadamard_block=None, signs=None, random_bits=None,
                 key=None, interpret=None, tile=None):
  """formats.quantize(hadamard.rotate(x, ...), spec, axis, key) in one pass, written
  with the blocked axis last (the layout Hopper's FP8 GEMM reads, fp4jax.kernels.
  hopper_gemm): a column-wise tile is transposed in the kernel, never the array.

  x: [..., n, ...]. Returns (values [..., ceil(n / block) * block] in fp8_dtype(spec),
  the elements with their zero padding; scales float32 [..., ceil(n / block)], 2^e),
  `...` being x's other axes in order. Randomness as fake_quantize.
  """
  if key is not None and spec.is_random:
    if random_bits is not None:
      raise ValueError("give random_bits or key, not both")
    random_bits = reference_bits(key, x.shape, axis, spec.block)
  axis = _check(x, spec, axis, hadamard_block, random_bits)
  values, scales = _call(x, spec, axis, hadamard_block, signs, random_bits, interpret, tile,
                         out="fp8")
  rest = x.shape[:axis] + x.shape[axis + 1:]
  return values.reshape(rest + (-1,)), scales.reshape(rest + (-1,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 6, 7))
def _fake_quantize(x, spec, axis, hadamard_block, signs, random_bits, interpret, tile):
  return _call(x, spec, axis, hadamard_block, signs, random_bits, interpret, tile,
               out="fake").reshape(x.shape)


def _fq_fwd(x, spec, axis, hadamard_block, signs, random_bits, interpret, tile):
  y = _fake_quantize(x, spec, axis, hadamard_block, signs, random_bits, interpret, tile)
  return y, signs


def _fq_bwd(spec, axis, hadamard_block, interpret, tile, signs, g):
  """Straight-through quantization; the rotation's own transpose."""
  del spec, interpret, tile
  if hadamard_block:
    _, rotate_vjp = jax.vjp(lambda y: hadamard.rotate(y, hadamard_block, axis, signs), g)
    (g,) = rotate_vjp(g)
  return g, None, None


_fake_quantize.defvjp(_fq_fwd, _fq_bwd)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fake_quantize(x, spec, axis=-1, *, hadamard_block=None, signs=None,
                  random_bits=None, key=None, interpret=None, tile=None):
  """formats.fake_quantize(hadamard.rotate(x, hadamard_block, axis, signs), spec, axis)
  in one pass, bit for bit; shape and dtype of x. Straight-through gradient.

  spec: any MX QuantSpec (not stochastic_dither). Randomness for stochastic
  rounding: `random_bits` (uint32, x's shape), or `key`, from which the bits
  are drawn exactly as formats.fake_quantize(..., key=key) draws them (a key
  is ignored for nearest rounding, as there).
  """
  if key is not None and spec.is_random:
    if random_bits is not None:
      raise ValueError("give random_bits or key, not both")
    random_bits = reference_bits(key, x.shape, axis, spec.block)
  axis = _check(x, spec, axis, hadamard_block, random_bits)
  return _fake_quantize(x, spec, axis, hadamard_block, signs, random_bits,
                        interpret, tile)


@functools.partial(jax.jit, static_argnames=("shape", "axis", "block"))
def reference_bits(key, shape, axis, block):
  """The uint32 bits (of `shape`) formats draws from `key` for blocks along `axis`.

  formats draws them for the zero-padded, blocked shape; the padding's bits
  are dropped here (they only ever round zeros).
  """
  axis %= len(shape)
  n = shape[axis]
  padded = target.whole_tiles(n, block)
  bits = jax.random.bits(key, shape[:axis] + (padded // block, block)
                         + shape[axis + 1:], jnp.uint32)
  bits = bits.reshape(shape[:axis] + (padded,) + shape[axis + 1:])
  return lax.slice_in_dim(bits, 0, n, axis=axis)
