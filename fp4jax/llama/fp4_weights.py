"""The FP4 weights of a linear layer as a packed checkpoint stores them ([out, in]).

The Fprop GEMM of a linear layer (fp4jax.dot) multiplies the activations by
its kernel quantized along the contraction axis: the float32 master kernel
is cast to the compute dtype (as flax's DenseGeneral casts it), its
contraction axes are flattened into one (K), it is rotated along K when the
recipe's Fprop rotates, and it is quantized with Fprop's rhs QuantSpec: 1D
blocks along K, or NVIDIA's square tiles. `fp4_weight` redoes exactly that
and returns the codes and scales in Hugging Face's [out, in] layout:

  packed   uint8 [out, in/2]: two E2M1 codes per byte along `in`, column 2j
           in the low nibble (fp4jax.pack_fp4)
  scales   [out, in/block]: float8_e4m3fn (NVFP4) or the uint8 bits of E8M0
           (MXFP4); a square tile's scale is repeated over the tile's rows,
           which is exact in this layout
  global   NVFP4's float32 per-tensor multiplier (QArray.global_scale), so
           W = code * scale * global; None for MXFP4

`plan(recipe, fmt)` says how a run's forward maps onto an export format:
exactly (its Fprop weight operand is that format, 1D blocks of the format's
size or square tiles, round to nearest, any scale rule, Four over Six, a
rotation without signs) or post-training (round to nearest onto the format's
default spec), and refuses what a packed checkpoint cannot declare (a
rotation with random signs). Bad input raises ConvertError (one line).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

import fp4jax
from fp4jax import fprop_operands
from fp4jax.llama.hf import ConvertError

# Export format -> its block (the group size of the packed layouts).
FORMATS = {"nvfp4": 16, "mxfp4": 32}
# The spec a run trained in another format is quantized with after training.
POST_TRAINING = {"nvfp4": fp4jax.QuantSpec("nvfp4"),
                 "mxfp4": fp4jax.QuantSpec("mxfp4", scale_mode="floor")}


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a run's linear layers are exported in format `fmt`.

  spec: the QuantSpec the weights are quantized with; rotation: the Fprop
  Hadamard (recipes.Hadamard, signs "none") or None; exact: True when spec
  and rotation are the trained forward's own; why: for a post-training plan,
  what the forward used instead (one line).
  """
  fmt: str
  spec: fp4jax.QuantSpec
  rotation: object
  exact: bool
  why: str = ""


def plan(recipe, fmt):
  """The Plan of recipes.Recipe `recipe` for export format `fmt` (in FORMATS)."""
  fprop = recipe.fprop
  spec, rotation = fprop.rhs, fprop.hadamard
  why = _not_exact(spec, fmt)
  if why:  # the unrotated weight: a rotation alone changes no product
    return Plan(fmt, POST_TRAINING[fmt], None, False, why)
  if rotation is not None and rotation.signs != "none":
    raise ConvertError(
        f"recipe {recipe.name!r} rotates Fprop with Hadamard signs "
        f"{rotation.signs!r}; a packed checkpoint declares only the plain "
        "block-diagonal Hadamard (signs 'none'), so its forward cannot be "
        "exported as trained")
  return Plan(fmt, spec, rotation, True)


def _not_exact(spec, fmt):
  """Why the Fprop weight spec is not exported exactly in `fmt` ("" if it is)."""
  if spec is None:
    return "leaves Fprop's weight unquantized"
  if spec.fmt != fmt:
    return f"quantizes Fprop's weight in {spec.fmt}"
  if spec.block != FORMATS[fmt]:
    return f"quantizes Fprop's weight in blocks of {spec.block}, not {FORMATS[fmt]}"
  if spec.rounding != "nearest" or spec.block_scale == "ms_eden":
    return (f"rounds Fprop's weight {spec.rounding} (a new draw every step)")
  return ""


@dataclasses.dataclass(frozen=True)
class Fp4Weight:
  """One linear layer's packed weight in the [out, in] layout (module doc)."""
  packed: np.ndarray
  scales: np.ndarray
  global_scale: np.float32 | None

  def dequantize(self):
    """float32 [out, in]: code * block scale (* global scale)."""
    codes = np.asarray(fp4jax.unpack_fp4(jnp.asarray(self.packed), axis=-1),
                       np.float32)
    if self.scales.dtype == np.uint8:  # E8M0 bits
      scales = np.ldexp(np.float32(1), self.scales.astype(np.int32) - 127)
    else:
      scales = self.scales.astype(np.float32)
    w = codes * np.repeat(scales, codes.shape[1] // scales.shape[1], axis=1)
    return w if self.global_scale is None else w * self.global_scale


def bad_scales(scales):
  """"" when every block scale of Fp4Weight.scales (E4M3, or the uint8 bits
  of E8M0) is finite and >= 0 (0: an all-zero block), else one line:
  how many are negative or NaN, and the first's value and [row, col]."""
  if scales.dtype == np.uint8:
    bad = scales == 255  # E8M0's NaN
  else:
    bad = ~(scales.astype(np.float32) >= 0)
  if not bad.any():
    return ""
  first = tuple(int(i) for i in np.argwhere(bad)[0])
  value = "NaN" if scales.dtype == np.uint8 else scales.astype(np.float32)[first]
  return (f"{int(bad.sum())} of its {bad.size} block scales are negative or "
          f"NaN (the first {value} at {list(first)})")


def fp4_weight(kernel, n_in, compute_dtype, p: Plan) -> Fp4Weight:
  """The Fp4Weight of one layer's float32 kernel (fp4jax layout, its n_in
  leading axes contracted, e.g. q [D, H, d] with n_in 1, o [H, d, D] with n_in
  2) as the Fprop GEMM quantizes it under Plan `p` in `compute_dtype`."""
  shape = kernel.shape
  k = int(np.prod(shape[:n_in]))
  block = FORMATS[p.fmt]
  if k % block or (p.rotation is not None and k % p.rotation.block):
    step = block if k % block else p.rotation.block
    raise ConvertError(f"a kernel of shape {list(shape)} contracts {k} inputs, "
                       f"not a multiple of {step}; {p.fmt} packs whole blocks")
  values, scales, g = fprop_operands.weight(jnp.asarray(kernel).reshape((k,) + shape[n_in:]),
                                            jnp.dtype(compute_dtype), p.spec, p.rotation)
  values = values.reshape(k, -1).T  # [out, in]
  n_out = values.shape[0]
  if p.spec.block_2d:  # [K/t, ceil(N/t)] tiles: each over t rows
    scales = jnp.repeat(scales.T, block, axis=0)[:n_out]
  else:  # [K/b, N...]
    scales = scales.reshape(k // block, -1).T
  scales = np.asarray(scales)
  if p.fmt == "mxfp4":
    scales = scales.view(np.uint8)
  return Fp4Weight(np.asarray(fp4jax.pack_fp4(values, axis=-1)),
                   np.ascontiguousarray(scales),
                   None if g is None else np.float32(g))


def fused_fp4_weights(kernels, n_in, compute_dtype, p: Plan) -> list:
  """[Fp4Weight] of kernels that an engine fuses into one GEMM (q, k, v or
  gate, up; same n_in leading axes), quantized as one kernel, their outputs
  side by side: one NVFP4 per-tensor scale from the group's amax, so the
  kernel with the largest amax keeps its codes and the others' may change.
  Square tiles need every kernel's outputs in whole tiles."""
  k = int(np.prod(kernels[0].shape[:n_in]))
  flat = [np.asarray(x).reshape(k, -1) for x in kernels]
  widths = [x.shape[1] for x in flat]
  if p.spec.block_2d and any(n % FORMATS[p.fmt] for n in widths):
    raise ConvertError(f"fused kernels with {widths} outputs do not split "
                       f"into whole {FORMATS[p.fmt]}x{FORMATS[p.fmt]} tiles")
  whole = fp4_weight(np.concatenate(flat, axis=1), 1, compute_dtype, p)
  rows = np.cumsum([0] + widths)
  return [Fp4Weight(whole.packed[a:b], whole.scales[a:b], whole.global_scale)
          for a, b in zip(rows[:-1], rows[1:])]


