"""The xla backend's GEMM dtype: bf16 operand values multiplied in float32 where
that is faster and gives the same bits (fp4jax.backends.xla.bf16_gemm)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import cpuinfo, dot, recipes
from fp4jax.backends import xla

_ICE_LAKE = ("model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz\n"
             "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n")
_SAPPHIRE_RAPIDS = ("model name\t: Intel(R) Xeon(R) Platinum 8481C\n"
                    "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
_ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx2 fma\n"
_GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def _flags(tmp_path, text):
  path = tmp_path / "cpuinfo"
  path.write_text(text)
  return cpuinfo.flags(cpuinfo.fields(str(path)))


def _never():
  raise AssertionError("the bit check runs only on a CPU without bf16 instructions")


@pytest.mark.parametrize("text,same_bits,want", [
    (_ICE_LAKE, lambda: True, "float32"),
    (_ICE_LAKE, lambda: False, "bfloat16"),
    (_ZEN3, lambda: True, "float32"),
    (_SAPPHIRE_RAPIDS, _never, "bfloat16"),
    (_GRAVITON3, _never, "bfloat16"),
])
def test_cpu_flags_and_the_bit_check_choose_the_dtype(tmp_path, text, same_bits, want):
  choice = xla.choose_bf16_gemm("cpu", _flags(tmp_path, text), same_bits)
  assert choice.dtype == want, choice
  assert choice.why


def test_a_gpu_keeps_bf16_gemms():
  assert xla.choose_bf16_gemm("gpu", frozenset(), _never).dtype == "bfloat16"


def test_without_cpuinfo_no_flags(tmp_path):
  assert cpuinfo.fields(str(tmp_path / "missing")) is None
  assert cpuinfo.flags(None) == frozenset()


_DIMS = (((1,), (0,)), ((), ()))
# Presets whose every quantized GEMM multiplies two E2M1 operands (MXFP4,
# NVFP4): few-bit products whose float32 sums are exact here in any order.
_FP4 = [n for n in recipes.recipe_names()
        if all(g.is_plain or (g.lhs.element_dtype == g.rhs.element_dtype == jnp.float4_e2m1fn)
               for g in (recipes.recipe(n).fprop, recipes.recipe(n).dgrad,
                         recipes.recipe(n).wgrad))]


def _gemm_outputs(name, monkeypatch):
  """{dtype: the float32 outputs of the preset's quantized GEMMs (Fprop, Dgrad,
  Wgrad, as dot_general runs them, on bf16 operands; Wgrad contracting the
  token axis) with its xla GEMMs of bf16 values run in dtype}, both from one
  program, whose quantizers XLA computes once for both."""
  r = recipes.recipe(name)
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (128, 256), jnp.bfloat16)
  w = (jax.random.normal(kw, (256, 96)) / 16).astype(jnp.bfloat16)
  dy = jax.random.normal(ky, (128, 96), jnp.bfloat16)

  def gemms(x, w, dy):
    operands = {"fprop": (x, w, _DIMS), "dgrad": (dy, w.T, _DIMS),
                "wgrad": (x, dy, (((0,), (0,)), ((), ())))}
    out = {}
    for dtype in ("bfloat16", "float32"):
      monkeypatch.setattr(xla, "bf16_gemm", lambda dtype=dtype: xla.GemmDtype(dtype, "test"))
      out[dtype] = [dot._gemm(a, b, dims, getattr(r, role), jax.random.key(1),
                              jax.random.key(2), r, None, jnp.float32)
                    for role, (a, b, dims) in operands.items()
                    if not getattr(r, role).is_plain]
    return out

  return jax.tree.map(lambda y: np.asarray(y).view(np.uint32), jax.jit(gemms)(x, w, dy))


def test_every_preset_gives_the_same_bits_in_either_gemm_dtype(monkeypatch):
  """Where this CPU's bf16 dot gives the float32 dot's bits (the only place the
  backend switches), every preset's forward and backward GEMMs give the same
  bits in both dtypes; where it does not, the FP4 presets' still do (their
  sums are exact) and the FP8 ones show the other order."""
  same_order = xla.bf16_dot_gives_float32_bits()
  differ = []
  for name in recipes.recipe_names():
    out = _gemm_outputs(name, monkeypatch)
    if not all(np.array_equal(a, b) for a, b in zip(out["bfloat16"], out["float32"])):
      differ.append(name)
  if same_order:
    assert differ == []
  else:
    assert not set(differ) & set(_FP4), differ
    assert "fp8" in differ and "mxfp8" in differ, differ
