"""Block-scaled FP8 GEMM for Hopper (Pallas Mosaic GPU): C[M, N] = A[M, K] B[N, K]^T.

A and B are FP8 (float8_e4m3fn or float8_e5m2, the two may differ), both
K-major, as Hopper's FP8 wgmma reads them. MXFP4 and NVFP4 run here with their
E2M1 codes held as float8_e4m3fn values (every E2M1 value is one exactly).
Optional block scales a_scales [K / 32, M] and b_scales [K / 32, N] (float32:
one per 32 elements along K, e.g. an E8M0 scale as 2^e) multiply each block's
partial product: per 32-wide block of K, one wgmma (K = 32 for FP8) writes the
block's products into a fresh float32 accumulator, and the compute warpgroup
adds `partial * a_scale[m] * b_scale[n]` to the float32 output it carries
(DeepGEMM's promotion of FP8 partial sums, here per block). A pipeline step
holds STEP_BLOCKS blocks: their wgmmas are issued together and each partial is
scaled and added, in K order, as soon as its wgmma is done, while the later
ones run (and the other compute warpgroup's wgmmas run while one scales).
Without scales the partials are added as they are (per-tensor FP8:
the caller applies the scales to C).

The fast mode (block=CHUNK, fp4jax.backends.mosaic_fast): the same with one
promotion per 128 elements of K: per step one chain of four K = 32 wgmmas
accumulates a 128-chunk in the tensor core, and the scales are one per chunk
(the 32-block scales folded into the elements by the caller). Its chunk sums
are not exact on the GPU (the tensor core accumulates FP8 products in reduced
precision); `reference` computes them in float32.

Exactness: the products of one block of E2M1 values are multiples of 0.25 up
to 36 in magnitude and their sum of 32 is at most 1152: exact in the tensor
core's accumulator; a power-of-two scale (or a product of two E4M3 scales, for
NVFP4's 16-element blocks padded to 32 with zeros) multiplies it exactly, away
from float32's overflow and underflow. C is then the sum of exact block
partials in increasing K order, rounded once per block: `reference` below.

Structure (as jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu): one CTA per
[2 * tile_m, tile_n] output tile; a memory warpgroup streams A, B and their
scales through TMA into `stages` shared-memory slots
(plgpu.emit_pipeline_warp_specialized) and two compute warpgroups, one per
[tile_m, tile_n] half, issue the wgmma of each block and scale its partial.
M and N are zero-padded to whole tiles and C cut back; K must be a multiple of
32 (the quantizers pad it) and is zero-padded to whole steps (a zero block adds
zero).

interpret: False compiles for the GPU; True (or an InterpretGPUParams) runs
jax's Mosaic GPU interpreter (CPU; slow, for tests); None follows the
lowering platform (compiled for CUDA, interpreted elsewhere), as
fp4jax.kernels.target does for the Triton kernels. Needs jax >= MIN_JAX.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fp4jax.kernels import target
from fp4jax.numerics import operand

BLOCK = 32  # elements along K per wgmma (FP8 wgmma has K = 32) and per block scale
CHUNK = 128  # the fast mode's elements along K per promotion: a chain of 4 wgmmas
# By block (elements of K per promotion), read with fp4jax.bench.sass_loops:
# [tile_m, tile_n] of one compute warpgroup (192 wide per 128-chunk: shared-memory
# reads, the scales' and the wgmmas' operands, stay below the tensor cores' time;
# it needs the 220 registers setmaxnreg gives a compute warpgroup); blocks per
# pipeline step (1 per 32: two live float32 accumulators, the output and one
# partial, 157 registers, so nothing spills even where ptxas ignores setmaxnreg;
# 2 would overlap one block's scaling with the next's wgmma in the same
# warpgroup, at 220 registers); the pipeline's shared-memory slots (what fits
# beside the float32 output tile).
TILE = {BLOCK: (64, 128), CHUNK: (64, 192)}
STEP_BLOCKS = {BLOCK: 1, CHUNK: 1}
STAGES = {BLOCK: 4, CHUNK: 3}
MIN_JAX = (0, 11)  # Mosaic GPU with mixed E4M3 / E5M2 wgmma and its CPU interpreter
FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def unavailable():
  """Why this jax cannot build the kernel (one line), or None."""
  if tuple(jax.__version_info__[:2]) < MIN_JAX:
    return (f"the Mosaic GPU GEMM needs jax >= {'.'.join(map(str, MIN_JAX))}; "
            f"installed: jax {jax.__version__}")
  try:
    from jax.experimental.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    return f"jax {jax.__version__} has no Pallas Mosaic GPU ({e})"
  return None


def _plgpu():
  reason = unavailable()
  if reason:
    raise RuntimeError(reason)
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu


def _kernel(a_gmem, b_gmem, *rest, k_steps, tile_m, tile_n, scaled, stages, block,
            step_blocks):
  """One CTA: C[2 tile_m, tile_n] at grid point (m, n), `step_blocks` blocks of `block`
  elements of K per step, one promotion per block."""
  plgpu = _plgpu()
  if scaled:
    sa_gmem, sb_gmem, c_gmem, out_smem = rest
  else:
    c_gmem, out_smem = rest
  m_slice = pl.ds(lax.axis_index("m") * 2 * tile_m, 2 * tile_m)
  n_slice = pl.ds(lax.axis_index("n") * tile_n, tile_n)
  wg = lax.axis_index("wg")
  wg_rows = pl.ds(wg * tile_m, tile_m)
  # One FP8 row of a block is `block` bytes: swizzled by as many (32 or 128).
  operand_transforms = (plgpu.TilingTransform((8, block)), plgpu.SwizzleTransform(block))

  def compute(run_pipeline):
    acc = plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA)
    acc = run_pipeline(acc)
    out_smem.at[wg][...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg], c_gmem.at[m_slice, n_slice].at[wg_rows])
    plgpu.wait_smem_to_gmem(0)

  def step(_, *refs):
    """Issues the wgmma of every block of the step, then scales and adds each partial
    in K order as soon as it is done, while the later blocks' wgmmas run."""
    a_blocks, b_blocks = refs[:step_blocks], refs[step_blocks:2 * step_blocks]
    *scales, acc = refs[2 * step_blocks:]

    def products(*part_refs):
      for part_ref, a_smem, b_smem in zip(part_refs, a_blocks, b_blocks):
        plgpu.wgmma(part_ref, a_smem.at[wg_rows], b_smem.T)
      out = acc
      for j, part_ref in enumerate(part_refs):
        part = plgpu.wgmma_accumulator_load(part_ref, wait_n=step_blocks - 1 - j)
        if scaled:
          sa_smem, sb_smem = scales
          sa = plgpu.load(sa_smem.at[j, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
          sb = plgpu.load(sb_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0))
          part = (part * lax.broadcast_in_dim(sa, part.shape, [0])
                  * lax.broadcast_in_dim(sb, part.shape, [1]))
        out = out + part
      return out

    return pl.run_scoped(products, *[plgpu.ACC((tile_m, tile_n), jnp.float32)] * step_blocks)

  spec = lambda rows, j: plgpu.BlockSpec(
      (rows, block), lambda k, j=j: (0, step_blocks * k + j), transforms=operand_transforms)
  in_specs = ([spec(2 * tile_m, j) for j in range(step_blocks)]
              + [spec(tile_n, j) for j in range(step_blocks)])
  operands = [a_gmem.at[m_slice]] * step_blocks + [b_gmem.at[n_slice]] * step_blocks
  if scaled:
    in_specs += [plgpu.BlockSpec((step_blocks, 2 * tile_m), lambda k: (k, 0)),
                 plgpu.BlockSpec((step_blocks, tile_n), lambda k: (k, 0))]
    operands += [sa_gmem.at[:, m_slice], sb_gmem.at[:, n_slice]]
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(k_steps,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
      num_compute_wgs=2, max_concurrent_steps=min(stages, k_steps), compute_context=compute)
  pipeline(*operands)


@functools.partial(jax.jit, static_argnames=("interpret", "tile", "stages", "block"))
def matmul(a, b, a_scales=None, b_scales=None, *, interpret=None, tile=None, stages=None,
           block=BLOCK):
  """C[M, N] float32 = sum over K-blocks j of (A_j B_j^T) * a_scales[j] b_scales[j]^T.

  a: [M, K] FP8, b: [N, K] FP8 (K-major), K a multiple of `block`; a_scales
  [K/block, M], b_scales [K/block, N] float32 or both None. block: the elements
  of K per promotion, BLOCK (32: one wgmma per block, the exact mode) or CHUNK
  (128: a chain of four wgmmas accumulating in the tensor core, the fast mode).
  tile: (tile_m, tile_n) of one compute warpgroup (tile_m a multiple of 64,
  tile_n of 8, at most 256; default TILE[block]); stages: the pipeline's
  shared-memory slots (default STAGES[block]).
  """
  plgpu = _plgpu()
  (m, k), (n, k2) = a.shape, b.shape
  if block not in STEP_BLOCKS:
    raise ValueError(f"block must be one of {sorted(STEP_BLOCKS)}; got {block}")
  if k != k2 or k % block or a.dtype not in FP8 or b.dtype not in FP8:
    raise ValueError(f"operands must be FP8 [M, K] and [N, K] with K a multiple of {block}; "
                     f"got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
  scaled = a_scales is not None
  if scaled != (b_scales is not None) or scaled and (
      a_scales.shape != (k // block, m) or b_scales.shape != (k // block, n)):
    raise ValueError(f"block scales must be [K/{block}, M] and [K/{block}, N] or both None; "
                     f"got {None if a_scales is None else a_scales.shape} and "
                     f"{None if b_scales is None else b_scales.shape} for M, N, K = {m, n, k}")
  tm, tn = tile or TILE[block]
  stages = stages or STAGES[block]
  pm, pn = target.whole_tiles(m, 2 * tm), target.whole_tiles(n, tn)
  step_blocks = STEP_BLOCKS[block]
  step_k = step_blocks * block  # K zero-padded to whole steps: zero blocks add zero
  pad = lambda x, rows: operand.pad_axis(operand.pad_axis(x, 0, rows), 1, step_k)
  operands = [pad(a, 2 * tm), pad(b, tn)]
  if scaled:
    pad_scales = lambda s, cols: operand.pad_axis(jnp.pad(
        s.astype(jnp.float32), ((0, -s.shape[0] % step_blocks), (0, 0)), constant_values=1),
        1, cols)
    operands += [pad_scales(a_scales, 2 * tm), pad_scales(b_scales, tn)]
  out_smem = plgpu.SMEM((2, tm, tn), jnp.float32)
  call = lambda interpret_as: plgpu.kernel(
      functools.partial(_kernel, k_steps=-(-k // step_k), tile_m=tm, tile_n=tn, scaled=scaled,
                        stages=stages, block=block, step_blocks=step_blocks),
      out_type=jax.ShapeDtypeStruct((pm, pn), jnp.float32),
      scratch_types=[out_smem],
      grid=(pm // (2 * tm), pn // tn), grid_names=("m", "n"),
      num_threads=3, thread_name="wg", interpret=interpret_as,
      kernel_name=f"fp4jax_hopper_gemm{'' if block == BLOCK else '_fast'}_{m}x{n}x{k}")
  if interpret is None:  # the interpreter's callbacks cannot sit in a platform_dependent
    c = lax.platform_dependent(*operands, cuda=call(False), default=lambda *x: _reference_padded(
        *x, scaled=scaled, block=block))
  else:
    c = call(_interpret_params() if interpret is True else interpret)(*operands)
  return target.cut_to(c, (m, n))


def _interpret_params():
  """jax's Mosaic GPU interpreter's default parameters (plgpu.kernel runs the
  interpreter when given them)."""
  return _plgpu().InterpretGPUParams()


def _reference_padded(*operands, scaled, block):
  return reference(*(operands if scaled else operands[:2]), block=block)


def reference(a, b, a_scales=None, b_scales=None, block=BLOCK):
  """What `matmul` computes, in jnp: each block's partial in float32 (exact for a
  32-block of E2M1 products; for a 128-chunk the float32 sum, which the GPU's
  tensor-core accumulation truncates: fp4jax.backends.mosaic_fast), scaled,
  summed over blocks in increasing K order (one rounding per block)."""
  (m, k), n = a.shape, b.shape[0]
  parts = jnp.einsum("mjb,njb->jmn", a.astype(jnp.float32).reshape(m, k // block, block),
                     b.astype(jnp.float32).reshape(n, k // block, block),
                     precision=lax.Precision.HIGHEST)
  if a_scales is not None:
    parts = parts * a_scales.astype(jnp.float32)[:, :, None] * b_scales.astype(jnp.float32)[:, None, :]
  return lax.fori_loop(0, k // block, lambda j, acc: acc + parts[j], jnp.zeros((m, n), jnp.float32))
