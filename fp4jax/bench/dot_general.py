"""Forward+backward time of one quantized GEMM, as ratios to plain lax.dot_general.

  python -m fp4jax.bench dot_general [--m 4096 --k 1024 --n 1024 --repeats 30]

Y[M, N] = X[M, K] W[K, N] on float32 inputs; one timed call runs the forward
and both backward GEMMs. Rows:
  bf16                    the `bf16` recipe, i.e. lax.dot_general itself (plain f32)
  plain, bf16 operands    lax.dot_general on bf16 casts, f32 accumulation (autodiff)
  NAME                    each `--recipes` preset (bf16 compute, the default)
  NAME, f32 compute       the same with compute_dtype="float32": the GEMMs are
                          those of plain f32, so the ratio is the quantization cost
  qwix ... mxfp4          qwix's dot_general_qt, mxfp4 on every operand of the
                          three GEMMs (when qwix is importable)
Variants are timed round-robin in one run and the fastest of `--repeats` calls
is kept (the least disturbed by other load on a shared machine). The header
names the CPU, its vector and bf16 instructions (AVX-512, avx512_bf16, AMX)
and the dtype the xla backend's GEMMs of bf16 values run in there
(fp4jax.bench.machine).
"""

import argparse
import dataclasses
import os
import time

import jax
from jax import lax
import jax.numpy as jnp

from fp4jax import dot, recipes
from fp4jax.bench import choice_list, machine, positive_int

_DIMS = (((1,), (0,)), ((), ()))


def fwd_bwd(f):
  """jit(x, w, dy -> (y, dx, dw)) for y = f(x, w) (also used by fp4jax.bench.kernels)."""
  def step(x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)
  return jax.jit(step)


def _bf16_operands(x, w):
  return lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), _DIMS,
                         preferred_element_type=jnp.float32)


def _recipe_fn(r):
  dg = dot.dot_general(r)
  return lambda x, w: dg(x, w, _DIMS, key=jax.random.key(1))


def _qwix_mxfp4():
  """(name, fn): qwix's dot_general_qt with mxfp4 everywhere; None without qwix."""
  try:
    import qwix  # pylint: disable=g-import-not-at-top
    from qwix._src.core import dot_general_qt as qt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  cfg = qt.DotGeneralQtConfig(
      lhs_qtype="mxfp4", rhs_qtype="mxfp4", dlhs_grad_qtype="mxfp4", drhs_grad_qtype="mxfp4",
      dlhs_residual_qtype="mxfp4", drhs_residual_qtype="mxfp4",
      tile_size=32, dlhs_tile_size=32, drhs_tile_size=32)
  name = f"qwix {getattr(qwix, '__version__', '')} dot_general_qt mxfp4"
  return name, lambda x, w: qt.dot_general_qt(x, w, _DIMS, cfg)


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench dot_general",
                              description=__doc__.splitlines()[0])
  p.add_argument("--m", type=positive_int, default=4096, help="rows of X")
  p.add_argument("--k", type=positive_int, default=1024, help="contraction")
  p.add_argument("--n", type=positive_int, default=1024, help="columns of W")
  p.add_argument("--repeats", type=positive_int, default=30)
  p.add_argument("--recipes", type=choice_list(recipes.recipe_names(), "recipe"),
                 default="mxfp4,mxfp4-dh16",
                 help="comma-separated presets of fp4jax.recipe_names()")
  return p


def main(argv):
  args = parser().parse_args(argv)

  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (args.m, args.k), jnp.float32)
  w = jax.random.normal(kw, (args.k, args.n), jnp.float32) / args.k ** 0.5
  dy = jax.random.normal(ky, (args.m, args.n), jnp.float32)

  variants = {"bf16": _recipe_fn(recipes.recipe("bf16")),
              "plain, bf16 operands": _bf16_operands}
  for name in args.recipes:
    r = recipes.recipe(name)
    variants[name] = _recipe_fn(r)
    variants[f"{name}, f32 compute"] = _recipe_fn(dataclasses.replace(r, compute_dtype="float32"))
  qwix = _qwix_mxfp4()
  if qwix is not None:
    variants[qwix[0]] = qwix[1]

  fns = {k: fwd_bwd(f) for k, f in variants.items()}
  for f in fns.values():
    jax.block_until_ready(f(x, w, dy))
  best = {k: float("inf") for k in fns}
  cpu = {k: float("inf") for k in fns}
  for _ in range(args.repeats):
    for k, f in fns.items():
      t, c = time.perf_counter(), time.process_time()
      jax.block_until_ready(f(x, w, dy))
      best[k] = min(best[k], time.perf_counter() - t)
      cpu[k] = min(cpu[k], time.process_time() - c)

  qwix_ms = best[qwix[0]] if qwix is not None else None
  print(f"fwd+bwd, M={args.m} K={args.k} N={args.n}, float32 inputs, best of "
        f"{args.repeats}, jax {jax.__version__}, load average {os.getloadavg()[0]:.1f}")
  print(f"{machine.describe()}; {machine.gemm_line()}")
  print("| variant | wall ms | vs plain f32 | vs qwix mxfp4 | CPU ms | vs plain f32 |")
  print("|---|---|---|---|---|---|")
  for k, t in best.items():
    vs_qwix = f"{t / qwix_ms:.2f}x" if qwix_ms else "-"
    print(f"| {k} | {t * 1e3:.1f} | {t / best['bf16']:.2f}x | {vs_qwix} | "
          f"{cpu[k] * 1e3:.1f} | {cpu[k] / cpu['bf16']:.2f}x |")
  if qwix is None:
    print("(qwix not importable: no qwix row)")
