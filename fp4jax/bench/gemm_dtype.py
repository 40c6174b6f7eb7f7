"""One GEMM on bf16 operands: bf16 -> float32 against float32 and bf16 -> bf16, time and bits.

  python -m fp4jax.bench gemm_dtype [--shapes 1024x128x384,1024x384x128,128x1024x384]
                                    [--repeats 50]

Per shape M x K x N: jitted lax.dot_general of Gaussian bf16 X[M, K] and
W[K, N] (seed 0) with float32 accumulation, once on the bf16 operands and once
on their (exact) float32 casts: the same products, summed in an order each
GEMM chooses. Printed: the fastest of `--repeats` round-robin calls of each,
their ratio, and the fraction of output elements whose bf16 roundings differ
(the float32 outputs differ only by round-off, so this counts bf16 rounding
ties). This is the difference between a bf16 model's FP8 GEMMs in bf16 and in
float32 (docs/numerics.md), and the one that plain_route="float32_output"
makes against lax.dot_general's (fp4jax.dot, "Plain GEMMs"). Also timed: the
bf16 x bf16 -> bf16 dot (no preferred type) of plain JAX, which jax 0.10.2
runs on the CPU as a float32 GEMM.
"""

import argparse
import os
import time
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fp4jax.bench import machine
from fp4jax.bench import positive_int

_DIMS = (((1,), (0,)), ((), ()))


def shape_list(text):
  """argparse type: comma-separated MxKxN triples of positive ints."""
  shapes = []
  for item in text.split(","):
    parts = item.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise argparse.ArgumentTypeError(f"{item!r} is not MxKxN (three positive integers)")
    shapes.append(tuple(int(p) for p in parts))
  return shapes


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench gemm_dtype",
                              description=__doc__.splitlines()[0])
  p.add_argument("--shapes", type=shape_list,
                 default=shape_list("1024x128x384,1024x384x128,128x1024x384"))
  p.add_argument("--repeats", type=positive_int, default=50)
  return p


def _gemm(dtype, out_dtype=jnp.float32):
  return jax.jit(lambda x, w: lax.dot_general(x.astype(dtype), w.astype(dtype), _DIMS,
                                              preferred_element_type=out_dtype))


class Measured(NamedTuple):
  """Fastest seconds of each GEMM, and the fraction of bf16-rounded outputs of
  the first two that differ."""
  bf16: float  # bf16 x bf16 -> float32
  f32: float  # float32 x float32 -> float32
  bf16_out: float  # bf16 x bf16 -> bf16
  differ: float


def measure(m, k, n, repeats):
  """Measured for one M x K x N shape (module docstring)."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (k, n), jnp.bfloat16)
  fns = {"bf16": _gemm(jnp.bfloat16), "f32": _gemm(jnp.float32),
         "bf16_out": _gemm(jnp.bfloat16, None)}
  outs = {name: jax.block_until_ready(f(x, w)) for name, f in fns.items()}
  best = dict.fromkeys(fns, float("inf"))
  for _ in range(repeats):
    for name, f in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(f(x, w))
      best[name] = min(best[name], time.perf_counter() - start)
  return Measured(**best, differ=bf16_differ_fraction(outs["bf16"], outs["f32"]))


def bf16_differ_fraction(a, b):
  """Fraction of elements of two float32 arrays (same shape) whose bf16 roundings differ."""
  return float(np.mean(np.asarray(jnp.asarray(a).astype(jnp.bfloat16))
                       != np.asarray(jnp.asarray(b).astype(jnp.bfloat16))))


def main(argv):
  args = parser().parse_args(argv)
  load = os.getloadavg()
  print(f"jax {jax.__version__}, {machine.describe()}, load average "
        f"{load[0]:.1f}; fastest of {args.repeats} calls")
  print("| M x K x N | bf16 x bf16 -> f32 (us) | f32 x f32 (us) | f32 / bf16 | "
        "bf16 x bf16 -> bf16 (us) | bf16 out / f32 out | bf16 outputs differing |")
  print("|---|---|---|---|---|---|---|")
  for m, k, n in args.shapes:
    t = measure(m, k, n, args.repeats)
    print(f"| {m} x {k} x {n} | {t.bf16 * 1e6:,.0f} | {t.f32 * 1e6:,.0f} | "
          f"{t.f32 / t.bf16:.2f} | {t.bf16_out * 1e6:,.0f} | {t.bf16_out / t.bf16:.2f} | "
          f"{t.differ:.1e} |")
