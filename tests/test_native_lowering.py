"""What the native backend hands XLA for CUDA and ROCm, checked on a machine without a GPU.

Each preset's y, dX and dW of one dense layer is lowered to StableHLO for the
"cuda" and "rocm" platforms (cross-platform lowering: jax's rules key on the
platform, not on the device, so the text is the same for every CUDA GPU,
Blackwell included). Per GEMM the native backend runs: on CUDA, MXFP8 and
NVFP4 reach XLA's block-scaled custom call (`__op$block_scaled_dot`, cuDNN's)
and MXFP4 the `xla.scaled_dot` composite (Triton's dot_scaled); on ROCm every
one is the composite; their operands are the FP4/FP8 elements and E8M0/E4M3
scales, fenced by an optimization barrier. Outside the composite's own
decomposition (what XLA runs where it does not rewrite the composite) no
low-precision array is converted up and every dot is a Hadamard rotation or
a GEMM the native backend does not take. What XLA's GPU passes then make of
this needs a device (benchmarks/gpu_check.sh): compiling here fails with
"No registered implementation for untyped custom call to
__op$block_scaled_dot for Host".
"""

import re

import jax
import jax.numpy as jnp
import pytest

from fp4jax import dot, recipes
from fp4jax.backends import native
from tests.helpers import NATIVE_PRESETS, native_recipe, needs_new_jax

DENSE = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N]
ARGS = (jax.ShapeDtypeStruct((64, 128), jnp.float32),
        jax.ShapeDtypeStruct((128, 96), jnp.float32))
MLIR = {"float4_e2m1fn": "f4E2M1FN", "float8_e4m3fn": "f8E4M3FN",
        "float8_e5m2": "f8E5M2", "float8_e8m0fnu": "f8E8M0FNU"}
LOW = "|".join(MLIR.values())
CUSTOM_CALL = "custom_call @__op$block_scaled_dot"
COMPOSITE = 'composite "xla.scaled_dot"'


def lowered(recipe, platforms=("cuda", "rocm")):
  """{platform: StableHLO text} of jit(y, dX, dW) of one dense layer under `recipe`."""
  dg = dot.dot_general(recipe)
  layer_key = jax.random.key(1) if recipe.needs_layer_key else None
  def step(x, w, key):
    y, vjp = jax.vjp(lambda a, b: dg(a, b, DENSE, key=key, layer_key=layer_key), x, w)
    return vjp(y)
  traced = jax.jit(step).trace(*ARGS, jax.random.key(0))
  return {p: traced.lower(lowering_platforms=(p,)).as_text() for p in platforms}


def outside_decompositions(text):
  """The lines of `text` outside the functions that composites name as their
  decomposition."""
  names = set(re.findall(r"decomposition = @([\w.$-]+)", text))
  lines, skip = [], False
  for line in text.splitlines():
    header = re.match(r"\s*func\.func \w+ @([\w.$-]+)", line)
    if header:
      skip = header.group(1) in names
    if not skip:
      lines.append(line)
  return lines


def _types(line):
  """The low-precision element types an op line names, in order."""
  return re.findall(rf"x({LOW})>", line)


def expected(recipe, platform):
  """[(op, element types, scale types)] of the GEMMs native runs, and how many GEMMs
  (plain or on xla) it does not."""
  ops, others = [], 0
  for role in recipes.ROLES:
    gemm = getattr(recipe, role)
    if gemm.is_plain or native.unsupported(gemm) is not None:
      others += 1
      continue
    elements = {MLIR[jnp.dtype(s.element_dtype).name] for s in (gemm.lhs, gemm.rhs)}
    scales = {MLIR[jnp.dtype(s.scale_dtype).name] for s in (gemm.lhs, gemm.rhs)}
    route = recipe.native_route
    if route == "auto":
      route = "scaled_matmul" if _cudnn_takes(elements, scales, gemm.lhs.block) else "scaled_dot"
    op = CUSTOM_CALL if platform == "cuda" and route == "scaled_matmul" else COMPOSITE
    ops.append((op, elements, scales))
  return ops, others


def _cudnn_takes(elements, scales, block):
  """Whether XLA's BlockScalingRewriter hands these formats to cuDNN: NVFP4 (E2M1,
  E4M3 scales, block 16) or MXFP8 (E4M3/E5M2, E8M0 scales, block 32)."""
  nvfp4 = elements == {"f4E2M1FN"} and scales == {"f8E4M3FN"} and block == 16
  mxfp8 = elements <= {"f8E4M3FN", "f8E5M2"} and scales == {"f8E8M0FNU"} and block == 32
  return nvfp4 or mxfp8


def _is_rotation(line, recipe):
  """Whether a dot_general line multiplies by a [h, h] Hadamard block of the recipe."""
  blocks = {getattr(recipe, r).hadamard.block for r in recipes.ROLES
            if getattr(recipe, r).hadamard is not None}
  return any(f"x{h}x{h}xf32>" in line or f"<{h}x{h}xf32>" in line for h in blocks)


def check(text, recipe, platform):
  """Asserts the module docstring's claims on one lowered text."""
  ops, others = expected(recipe, platform)
  lines = outside_decompositions(text)
  found = [(op, line) for line in lines for op in (CUSTOM_CALL, COMPOSITE) if op in line]
  assert sorted(op for op, _ in found) == sorted(op for op, _, _ in ops), platform
  for (op, line), (_, elements, scales) in zip(sorted(found), sorted(ops, key=lambda o: o[0])):
    types = _types(line.split(" : ")[-1])
    assert set(types[:2]) == elements and set(types[2:4]) == scales, line
  fenced = [l for l in lines if "stablehlo.optimization_barrier" in l and len(_types(l)) == 4]
  assert len(fenced) == len(ops)
  assert not [l for l in lines if "stablehlo.convert" in l and re.search(rf"\(tensor<[\dx]*({LOW})>\)", l)]
  dots = [l for l in lines if "stablehlo.dot_general" in l and not _is_rotation(l, recipe)]
  assert len(dots) == others, dots


@needs_new_jax
@pytest.mark.parametrize("name", NATIVE_PRESETS)
def test_every_native_gemm_lowers_to_a_block_scaled_op(name):
  recipe = native_recipe(name)
  for platform, text in lowered(recipe).items():
    check(text, recipe, platform)


@needs_new_jax
@pytest.mark.parametrize("name,route,want", [("mxfp4", "scaled_matmul", CUSTOM_CALL),
                                             ("mxfp8", "scaled_dot", COMPOSITE)])
def test_a_forced_route_lowers_to_its_op(name, route, want):
  recipe = native_recipe(name, route)
  text = lowered(recipe, ("cuda",))["cuda"]
  check(text, recipe, "cuda")
  assert sum(want in line for line in outside_decompositions(text)) == 3
