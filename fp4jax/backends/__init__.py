"""GEMM backends: how one GEMM of a recipe quantizes its operands and multiplies them.

fp4jax.dot calls, per quantized GEMM, one backend module through four functions:

  unsupported(gemm) -> str | None
      why this backend cannot run `gemm` (a recipes.Gemm); fp4jax.dot then runs
      that GEMM on `xla` and logs the reason once.
  quantize(x, spec, rotation, signs, axis, key, compute_dtype) -> operand
      x zero-padded and rotated (rotation: recipes.Hadamard or None, with the
      +-1 `signs` or None) and quantized with `spec` (a QuantSpec, or None: not
      quantized) along `axis`, the GEMM's flattened contraction axis. The
      operand's type is the backend's own; only its `matmul` reads it.
  from_qarray(q, dtype, compute_dtype) -> operand
      the operand `quantize` returns, from q = formats.quantize of the same
      rotated input (dtype: that input's dtype) along `axis`: how a saved,
      already quantized operand (fp4jax.residuals) reaches the GEMM.
  matmul(a, b, dims, precision, out_sharding, route) -> float32 array
      lax.dot_general(a, b, dims) of two operands of this backend (dims a
      dot_general's dimension numbers, each operand contracting its `axis`),
      with every float32 factor of the operands (NVFP4 per-tensor scales,
      stochastic_dither's 4/3) applied to the float32 output. route: the
      recipe's native_route (NATIVE_ROUTES; only `native` reads it).

and declarations:

  QUANTIZES_WHOLE_TENSOR_FIRST: bool
      True when a per-tensor, deterministic, unrotated operand (FP8) is to be
      quantized before its layout changes: one scale for the whole tensor
      gives the same values in any layout, and XLA then merges the
      quantizations of an array that several GEMMs read (fp4jax.dot).
  PARTITIONED_BY_XLA: bool
      True when XLA's SPMD partitioner splits everything the backend emits
      (`xla`, `native`). False for a backend with kernels (custom calls:
      `pallas`, `mosaic`): under a mesh, with the operands' specs given to
      dot_general, its `quantize` takes `layout=` (the flattened operand's
      fp4jax.shard_local.Layout) and runs its kernel per shard; a backend that
      also declares SHARD_LOCAL_MATMUL (`mosaic`) has its `matmul` take
      `plan=` (a shard_local.Plan) and run its GEMM per shard, summing a split
      contraction (psum).
  LHS_IN_PLACE: bool (optional, default False)
      True when a GEMM's FP4 lhs (nearest rounding) is quantized along its
      contraction axis where it lies, as the rhs is (`xla`: the Wgrad lhs X
      along its token axis, no transposed copy; fp4jax.dot._lhs_last);
      otherwise fp4jax.dot hands the lhs over with its contraction axis last.

Backends (NAMES): `xla` (jnp fake quantization, then a GEMM in the compute
dtype; the reference), `pallas` (fp4jax.kernels' fused rotate + quantize, the
xla GEMM), `native` (real FP4/FP8 element and E8M0/E4M3 scale arrays into
one block-scaled GEMM, jax.nn.scaled_matmul or lax.scaled_dot by format;
needs jax >= 0.11) and `mosaic` (FP8 values, E2M1 held as E4M3, into
fp4jax.kernels.hopper_gemm, a Pallas Mosaic GPU kernel for Hopper's FP8
tensor cores that scales each 32-element block's partial product; needs
jax >= 0.11, picked by `auto` on jax >= 0.12) and `mosaic_fast` (mosaic's
quantization, one promotion per 128 elements of K: MXFP4's block scales folded
into E4M3 elements; not bit-exact on a GPU; never picked by `auto`). A new
backend is one module here plus its name in NAMES.

`resolve(name)` turns "auto" into a backend name for the default device;
`for_gemm(name, gemm)` returns the module that runs a GEMM; `check_recipe`
refuses a recipe the installed jax cannot run.
"""

import functools
import importlib
import logging

import jax
from jax import lax
import jax.numpy as jnp

NAMES = ("xla", "pallas", "native", "mosaic", "mosaic_fast")
# Oldest jax a backend runs on (default: the project's floor), and what it needs there.
MIN_JAX = {"native": (0, 11), "mosaic": (0, 11), "mosaic_fast": (0, 11)}
# Oldest jax `auto` picks a backend on: mosaic's SASS (QGMMA) was read deviceless on
# jax 0.12.1; on 0.11.2 it compiles deviceless to Mosaic GPU GEMMs on FP8 operands
# and equals its interpreter, but that jax's executables hold no SASS to read.
AUTO_MIN_JAX = {"native": (0, 11), "mosaic": (0, 12)}
_NEEDS = {"native": "jax.nn.scaled_matmul with a CPU lowering",
          "mosaic": "Pallas Mosaic GPU with mixed E4M3 x E5M2 wgmma",
          "mosaic_fast": "Pallas Mosaic GPU with mixed E4M3 x E5M2 wgmma"}
# The native backend's GEMM op per route ("auto": by format, native.route_for).
NATIVE_ROUTES = {"auto": None, "scaled_matmul": ("nn", "scaled_matmul"),
                 "scaled_dot": ("lax", "scaled_dot")}


def jax_version() -> tuple[int, ...]:
  return tuple(jax.__version_info__)


def check_jax(name: str):
  """Raises ValueError when the installed jax is too old for backend `name`."""
  need = MIN_JAX.get(name)
  if need is not None and jax_version()[:len(need)] < need:
    raise ValueError(f"backend {name!r} needs jax >= {'.'.join(map(str, need))} "
                     f"({_NEEDS[name]}); installed: jax "
                     f"{jax.__version__} (Python >= 3.12 installs newer jax)")


def check_native_route(route: str):
  """Raises ValueError (one line) for a native route whose op the installed jax lacks."""
  op = NATIVE_ROUTES[route]
  if op is not None and not hasattr(getattr(jax, op[0]), op[1]):
    raise ValueError(f"native_route {route!r} needs jax.{op[0]}.{op[1]}, which the "
                     f"installed jax {jax.__version__} lacks")


def check_recipe(recipe):
  """Raises ValueError (one line) when the installed jax cannot run the recipe's
  backend or native route: where a recipe meets a backend (fp4jax.dot_general,
  the trainer's start-up)."""
  check_jax(recipe.backend)
  check_native_route(recipe.native_route)


def module(name: str):
  """The backend module fp4jax.backends.<name>."""
  if name not in NAMES:
    raise ValueError(f"unknown backend {name!r}; valid: {', '.join(NAMES)}")
  return importlib.import_module(f"fp4jax.backends.{name}")


@functools.cache
def resolve(name: str) -> str:
  """`name`, or for "auto" the backend for the default device: `native` on NVIDIA
  GPUs with block-scaled matrix units (compute capability >= 10; jax >= 0.11),
  `mosaic` on Hopper (compute capability 9.x; jax >= 0.12, AUTO_MIN_JAX), `pallas` on other
  GPUs, `xla` elsewhere. Logs an "auto" decision once."""
  if name != "auto":
    return name
  reasons = []
  for candidate in ("native", "mosaic"):
    reason = module(candidate).unsupported_device()
    if reason is None and jax_version() < AUTO_MIN_JAX[candidate]:
      reason = f"jax {jax.__version__} < {'.'.join(map(str, AUTO_MIN_JAX[candidate]))}"
    if reason is None:
      logging.info("fp4jax: backend auto -> %s", candidate)
      return candidate
    reasons.append(f"{candidate}: {reason}")
  choice = "pallas" if jax.default_backend() == "gpu" else "xla"
  logging.info("fp4jax: backend auto -> %s (%s)", choice, "; ".join(reasons))
  return choice


def for_gemm(name: str, gemm):
  """The backend module that runs `gemm` for a recipe's backend `name` (or auto)."""
  chosen = module(resolve(name))
  reason = chosen.unsupported(gemm)
  if reason is None:
    return chosen
  _log_fallback(chosen.__name__.rsplit(".", 1)[-1], reason)
  return module("xla")


@functools.cache
def _log_fallback(name, reason):
  logging.warning("fp4jax: backend %s runs this GEMM on xla: %s", name, reason)


def cuda_capability(device):
  """(major, minor) of an NVIDIA GPU `device`'s compute capability, or the
  line saying why it has none."""
  if device.platform != "gpu":
    return f"platform is {device.platform!r}, not an NVIDIA GPU"
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return f"{device.device_kind} reports no compute capability (not CUDA)"
  major, _, minor = str(capability).partition(".")
  return int(major), int(minor.split(".")[0] or 0)


def apply_factors(y, *factors):
  """y (float32) times the product of the float32 scalar factors that are not None,
  in the order given: the epilogue every backend shares."""
  scale = None
  for f in factors:
    if f is not None:
      scale = f if scale is None else scale * f
  return y if scale is None else y * scale


def fence_dot_output(y, compute_dtype):
  """y, the float32 output of a dot of `compute_dtype` operands, behind an
  optimization barrier for bf16 operands on the CPU. Works around XLA:CPU (jax
  0.10.2): a bf16 x bf16 -> f32 dot whose result is transposed later (by dot's
  layout, vmap or the caller) has the transpose folded into it and fails with
  "Unsupported element type for DotThunk::Execute"."""
  if compute_dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    return lax.optimization_barrier(y)
  return y
