"""Quantization throughput against the memory-bandwidth limit.

  python -m fp4jax.bench kernels [--size S] [--linear M,K,N] [--repeats R] [--out FILE]

Input: one [S, S] bf16 tensor (GPU default S = 8192, CPU 2048). Every
variant is timed round-robin in one run; the fastest of `--repeats` calls is
kept (the least disturbed on a shared machine). Bytes = bytes read + bytes
written: a quantize reads 2 B/element and writes 0.5 B of packed E2M1 plus
1/32 B of E8M0 scale; a fake quantize reads and writes 2 B/element.

  negate (copy)       -x: one read and one write of every element, the copy
                      bandwidth every other row is a fraction of
  xla ...             fp4jax.formats on the same tensor (quantize returns
                      float4 values, which XLA stores one per byte: its true
                      traffic is higher than the bytes counted)
  pallas ...          fp4jax.kernels.quantize, compiled (GPU only; on the CPU
                      Pallas only interprets, which measures nothing)
  row / col           blocks along the last / first axis; +H16: rotation first
  linear              fwd+bwd of Y = X W ([M,K] x [K,N], bf16) with the
                      `mxfp4-dh16` recipe per dot_general backend, against
                      plain bf16 lax.dot_general (GPU default M,K,N =
                      16384,4096,14336; CPU 1024,1024,1024)
  gemm fwd only       (GPU) Y = X W alone: bf16 vs kernels.gemm.matmul_packed
                      on operands quantized beforehand
"""

import argparse
import dataclasses
import datetime
import platform
import sys
import time

import jax
from jax import lax
import jax.numpy as jnp

from fp4jax import dot, formats, hadamard, recipes
from fp4jax.bench import choice_list, positive_int
from fp4jax.bench.dot_general import fwd_bwd
from fp4jax.kernels import gemm
from fp4jax.kernels import quantize as kq

MXFP4 = formats.QuantSpec("mxfp4")
_DIMS = (((1,), (0,)), ((), ()))


def _xla_quantize(axis, h):
  def fn(x):
    x = hadamard.rotate(x, h, axis) if h else x
    q = formats.quantize(x, MXFP4, axis)
    return q.values, q.scales
  return fn


def _xla_fake(axis, h):
  return lambda x: formats.fake_quantize(hadamard.rotate(x, h, axis) if h else x, MXFP4, axis)


def _quant_variants(on_gpu):
  """name -> (fn, bytes per element moved)."""
  packed, fake = 2 + 0.5 + 1 / 32, 4
  out = {"negate (copy)": (lambda x: -x, 4)}
  for layout, axis in (("row", -1), ("col", 0)):
    for h in (None, 16):
      tag = f"{layout}{' +H16' if h else ''}"
      out[f"xla quantize {tag}"] = (_xla_quantize(axis, h), packed)
      out[f"xla fake_quantize {tag}"] = (_xla_fake(axis, h), fake)
      if on_gpu:
        out[f"pallas quantize {tag}"] = (
            lambda x, a=axis, h=h: kq.quantize_packed(x, MXFP4, a, hadamard_block=h), packed)
        out[f"pallas fake_quantize {tag}"] = (
            lambda x, a=axis, h=h: kq.fake_quantize(x, MXFP4, a, hadamard_block=h), fake)
  return out


def _linear_variants(backends):
  out = {"linear bf16 (lax.dot_general)": lambda x, w: lax.dot_general(
      x, w, _DIMS, preferred_element_type=jnp.float32).astype(x.dtype)}
  for backend in backends:
    r = dataclasses.replace(recipes.recipe("mxfp4-dh16"), backend=backend)
    dg = dot.dot_general(r)
    out[f"linear mxfp4-dh16 ({backend})"] = lambda x, w, dg=dg: dg(x, w, _DIMS)
  return {name: fwd_bwd(f) for name, f in out.items()}


def _packed(x):
  """(codes, scales) of x quantized along its last axis by the XLA reference."""
  q = formats.quantize(x, MXFP4, -1)
  return formats.pack_fp4(q.values, -1), q.scales


def _gemm_times(x, w, repeats):
  """Forward GEMM alone: bf16 operands vs packed MXFP4 operands (quantized once)."""
  a, b = _packed(x), _packed(w.T)
  fns = {"gemm fwd only, bf16": jax.jit(
             lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
         "gemm fwd only, packed mxfp4 (pallas)": gemm.matmul_packed}
  args = {"gemm fwd only, bf16": (x, w), "gemm fwd only, packed mxfp4 (pallas)": a + b}
  return _fastest(fns, args, repeats)


def _fastest(fns, args, repeats):
  """name -> fastest seconds of `repeats` round-robin calls; errors as strings."""
  best, live = {}, {}
  for name, fn in fns.items():
    try:
      jax.block_until_ready(fn(*args[name]))  # compile and warm up
      live[name], best[name] = fn, float("inf")
    except Exception as e:  # a backend that cannot run here is reported, not fatal
      best[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
  for _ in range(repeats):
    for name, fn in live.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(*args[name]))
      best[name] = min(best[name], time.perf_counter() - t)
  return best


def run(size, linear, repeats, backends):
  """Markdown table (str) of both benchmarks."""
  on_gpu = jax.default_backend() == "gpu"
  x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  quant = _quant_variants(on_gpu)
  times = _fastest({k: jax.jit(f) for k, (f, _) in quant.items()}, {k: (x,) for k in quant},
                   repeats)
  t_copy = times["negate (copy)"]
  rows = [f"| {size}x{size} bf16 | time (ms) | GB/s | fraction of copy | time / negate |",
          "|---|---|---|---|---|"]
  for name, (_, per_elem) in quant.items():
    t = times[name]
    if isinstance(t, str):
      rows.append(f"| {name} | {t} | | | |")
      continue
    gbs = per_elem * size * size / t / 1e9
    rows.append(f"| {name} | {t * 1e3:.2f} | {gbs:.1f} | "
                f"{t_copy / t * per_elem / 4:.2f} | {t / t_copy:.2f} |")
  m, k, n = linear
  kx, kw, ky = jax.random.split(jax.random.key(1), 3)
  xw = (jax.random.normal(kx, (m, k), jnp.bfloat16),
        (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16),
        jax.random.normal(ky, (m, n), jnp.bfloat16))
  lin = _linear_variants(backends)
  lt = _fastest(lin, {k: xw for k in lin}, repeats)
  base = lt["linear bf16 (lax.dot_general)"]
  rows += ["", f"| fwd+bwd, M,K,N = {m},{k},{n} | time (ms) | / bf16 |", "|---|---|---|"]
  if on_gpu:
    lt.update(_gemm_times(xw[0], xw[1], repeats))
  for name, t in lt.items():
    rows.append(f"| {name} | {t} | |" if isinstance(t, str)
                else f"| {name} | {t * 1e3:.2f} | {t / base:.2f} |")
  dev = jax.devices()[0]
  head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{dev.device_kind} ({jax.default_backend()}, {jax.device_count()} devices), "
          f"{platform.processor() or platform.machine()}, jax {jax.__version__}; "
          f"fastest of {repeats}\n")
  return head + "\n" + "\n".join(rows) + "\n"


def _dims(text):
  """argparse type: M,K,N as three ints >= 1."""
  dims = [positive_int(v) for v in text.split(",")]
  if len(dims) != 3:
    raise argparse.ArgumentTypeError(f"{text!r} is not M,K,N (three ints)")
  return tuple(dims)


def parser():
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench kernels",
                              description=__doc__.splitlines()[0])
  p.add_argument("--size", type=positive_int, default=8192 if on_gpu else 2048)
  p.add_argument("--linear", type=_dims,
                 default="16384,4096,14336" if on_gpu else "1024,1024,1024",
                 help="M,K,N of the linear layer")
  p.add_argument("--repeats", type=positive_int, default=20 if on_gpu else 5)
  p.add_argument("--backends", type=choice_list(("xla", "pallas"), "backend"),
                 default="xla,pallas" if on_gpu else "xla",
                 help="dot_general backends of the mxfp4-dh16 linear")
  p.add_argument("--out", default=None, help="also write the table to this file")
  return p


def main(argv):
  args = parser().parse_args(argv)
  table = run(args.size, args.linear, args.repeats, args.backends)
  cmd = "python -m fp4jax.bench kernels " + " ".join(argv)
  table = f"`{cmd.strip()}`\n\n" + table
  sys.stdout.write(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table)
