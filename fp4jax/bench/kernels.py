"""Quantization throughput against the memory-bandwidth limit.

  python -m fp4jax.bench kernels [--size S] [--linear M,K,N] [--repeats R] [--out FILE]

Input: one [S, S] bf16 tensor (GPU default S = 8192, CPU 2048). Every
variant is compiled ahead of time and timed round-robin in one run; the
fastest of `--repeats` samples is kept (the least disturbed on a shared
machine; a sample: back-to-back calls filling ~1 ms, see `measure`). The
`kernels` column counts one call's kernel launches in the optimized HLO
(fp4jax.bench.hlo_stats). Bytes = bytes read + bytes
written: a quantize reads 2 B/element and writes 0.5 B of packed E2M1 plus
1/32 B of E8M0 scale; a fake quantize reads and writes 2 B/element.

  negate (copy)       -x: one read and one write of every element, the copy
                      bandwidth every other row is a fraction of
  xla ...             fp4jax.numerics.formats on the same tensor (quantize returns
                      float4 values, which XLA stores one per byte: its true
                      traffic is higher than the bytes counted)
  pallas ...          fp4jax.kernels.quantize, compiled (GPU only; on the CPU
                      Pallas only interprets, which measures nothing)
  row / col           blocks along the last / first axis; +H16: rotation first
  linear              fwd+bwd of Y = X W ([M,K] x [K,N], bf16) with the
                      `mxfp4-dh16` recipe per dot_general backend, against
                      plain bf16 lax.dot_general (GPU default M,K,N =
                      16384,4096,14336; CPU 1024,1024,1024); TFLOP/s counts
                      the three GEMMs' 6MKN flops
  gemm fwd only       (GPU) Y = X W alone: bf16 vs kernels.hopper_gemm.matmul
                      (the `mosaic` backend's Hopper FP8 GEMM) on MXFP4
                      operands quantized beforehand
"""

import argparse
import dataclasses
import datetime
import platform
import sys
import time

import jax
import jax.numpy as jnp

from fp4jax import dot, recipes
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.bench import hlo_stats
from fp4jax.bench import choice_list, positive_int
from fp4jax.bench.dot_general import fwd_bwd
from fp4jax.kernels import hopper_gemm
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


def quantize_variants(pallas):
  """name -> (fn, bytes per element moved); pallas: add the kernels' rows."""
  packed, fake = 2 + 0.5 + 1 / 32, 4
  out = {"negate (copy)": (lambda x: -x, 4)}
  for layout, axis in (("row", -1), ("col", 0)):
    for h in (None, 16):
      tag = f"{layout}{' +H16' if h else ''}"
      out[f"xla quantize {tag}"] = (_xla_quantize(axis, h), packed)
      out[f"xla fake_quantize {tag}"] = (_xla_fake(axis, h), fake)
      if pallas:
        out[f"pallas quantize {tag}"] = (
            lambda x, a=axis, h=h: kq.quantize_packed(x, MXFP4, a, hadamard_block=h), packed)
        out[f"pallas fake_quantize {tag}"] = (
            lambda x, a=axis, h=h: kq.fake_quantize(x, MXFP4, a, hadamard_block=h), fake)
  return out


# The unquantized layer, as the `bf16` recipe runs it on each Recipe.plain_route:
# lax.dot_general with bf16 operands and output (what a bf16 model's Dense runs; the
# ratio column's reference), and its three GEMMs with float32 outputs rounded once
# (the route every quantized GEMM takes). Both keep every GEMM's operands in bf16
# (asking lax.dot_general for a float32 output instead would run the backward's two
# GEMMs on float32 operands: an H200 ran them at half the bf16 rate).
BASELINE = "bf16 (lax.dot_general)"
BASELINES = {BASELINE: "lax", "bf16 float32_output": "float32_output"}


def linear_variants(recipe_names, backends):
  """name -> jitted (x, w, dy) -> (y, dx, dw): the plain bf16 baselines (BASELINES),
  then `RECIPE (BACKEND)` for each recipe and dot_general backend (fixed keys for
  random recipes); a backend "native:ROUTE" is native with native_route=ROUTE."""
  out = {}
  for name, route in BASELINES.items():
    plain = dataclasses.replace(recipes.recipe("bf16"), plain_route=route)
    out[name] = lambda x, w, dg=dot.dot_general(plain): dg(x, w, _DIMS)
  for name in recipe_names:
    for backend in backends:
      name_, _, route = backend.partition(":")
      recipe = dataclasses.replace(recipes.recipe(name), backend=name_,
                                   native_route=route or "auto")
      keys = dict(key=jax.random.key(0) if recipe.is_random else None,
                  layer_key=jax.random.key(1) if recipe.needs_layer_key else None)
      out[f"{name} ({backend})"] = (
          lambda x, w, dg=dot.dot_general(recipe), keys=keys: dg(x, w, _DIMS, **keys))
  return {name: fwd_bwd(f) for name, f in out.items()}


def _fp8_operand(x):
  """x [rows, K] MXFP4-quantized along K as hopper_gemm reads it: (E2M1 values as
  float8_e4m3fn [rows, K], float32 block scales [K / 32, rows])."""
  q = formats.quantize(x, MXFP4, -1)
  return q.values.astype(jnp.float8_e4m3fn), q.scales.astype(jnp.float32).T


def gemm_variants(x, w):
  """Forward GEMM alone: bf16 operands vs MXFP4 operands (quantized once) on the
  Hopper FP8 GEMM (needs jax >= 0.12 and a Hopper GPU; elsewhere its row is an error).

  Returns (name -> jitted fn, name -> args).
  """
  (av, asc), (bv, bsc) = _fp8_operand(x), _fp8_operand(w.T)
  fns = {"gemm fwd only, bf16": jax.jit(
             lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
         "gemm fwd only, mxfp4 (mosaic)": jax.jit(
             lambda av, bv, asc, bsc: hopper_gemm.matmul(av, bv, asc, bsc))}
  args = {"gemm fwd only, bf16": (x, w), "gemm fwd only, mxfp4 (mosaic)": (av, bv, asc, bsc)}
  return fns, args


def measure(fns, args, repeats, sample_s=1e-3):
  """name -> {"seconds": per call, the fastest of `repeats` round-robin
  samples; "hlo": the optimized HLO text} or {"error": one line}; fns are jitted.

  Each is compiled once, ahead of time; a variant that cannot run here is
  reported, not fatal. A sample is as many back-to-back calls as fill about
  `sample_s` (at least one), timed to the last result, so that on a GPU the
  dispatch of one call overlaps the previous call's kernels.
  """
  out, live = {}, {}
  for name, fn in fns.items():
    try:
      compiled = fn.lower(*args[name]).compile()
      jax.block_until_ready(compiled(*args[name]))  # warm up
      t = time.perf_counter()
      jax.block_until_ready(compiled(*args[name]))
      calls = max(1, min(20, round(sample_s / (time.perf_counter() - t))))
      live[name] = compiled, calls
      out[name] = {"seconds": float("inf"), "calls_per_sample": calls,
                   "hlo": compiled.as_text()}
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  for _ in range(repeats):
    for name, (compiled, calls) in live.items():
      t = time.perf_counter()
      for _ in range(calls):
        result = compiled(*args[name])
      jax.block_until_ready(result)
      out[name]["seconds"] = min(out[name]["seconds"], (time.perf_counter() - t) / calls)
  return out


def quantize_rows(size, repeats, pallas):
  """One dict per quantize variant on a [size, size] bf16 tensor: name, ms,
  GB/s, copy_fraction (of negate's bandwidth), vs_copy (time / negate's),
  kernels (launches per call); or name, error."""
  x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  quant = quantize_variants(pallas)
  times = measure({k: jax.jit(f) for k, (f, _) in quant.items()}, {k: (x,) for k in quant},
                  repeats)
  t_copy = times["negate (copy)"].get("seconds")
  rows = []
  for name, (_, per_elem) in quant.items():
    m = times[name]
    if "error" in m or t_copy is None:
      rows.append({"name": name, "error": m.get("error", "negate (copy) failed")})
      continue
    t = m["seconds"]
    rows.append({"name": name, "ms": t * 1e3, "GB/s": per_elem * size * size / t / 1e9,
                 "copy_fraction": t_copy / t * per_elem / 4, "vs_copy": t / t_copy,
                 "kernels": sum(hlo_stats.kernel_counts(m["hlo"]).values())})
  return rows


def linear_inputs(m, k, n):
  """bf16 X [M, K], W [K, N] (scaled by 1/sqrt(K)) and dY [M, N]."""
  kx, kw, ky = jax.random.split(jax.random.key(1), 3)
  return (jax.random.normal(kx, (m, k), jnp.bfloat16),
          (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16),
          jax.random.normal(ky, (m, n), jnp.bfloat16))


def linear_rows(shape, recipe_names, backends, repeats, gemm_only=False, hlo_dir=None):
  """One dict per fwd+bwd variant of the [M,K] x [K,N] layer: name, ms,
  vs_bf16, TFLOP/s (the three GEMMs' 6MKN flops over the time), kernels,
  gemms (hlo_stats.gemm_summary: block-scaled or plain); or name, error. gemm_only adds the forward GEMM alone (bf16 vs the Hopper FP8 GEMM;
  vs_bf16 of those two is against the bf16 forward GEMM).
  hlo_dir: write each variant's optimized HLO there (for a missed goal).
  """
  m, k, n = shape
  xw = linear_inputs(m, k, n)
  lin = linear_variants(recipe_names, backends)
  times = measure(lin, {name: xw for name in lin}, repeats)
  flops = {name: 6 * m * k * n for name in lin}
  if gemm_only:
    fns, args = gemm_variants(xw[0], xw[1])
    times.update(measure(fns, args, repeats))
    flops.update({name: 2 * m * k * n for name in fns})
  base = times[BASELINE].get("seconds")
  gemm_base = times.get("gemm fwd only, bf16", {}).get("seconds")
  rows = []
  for name, meas in times.items():
    if hlo_dir and "hlo" in meas:
      slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
      with open(f"{hlo_dir}/{m}x{k}x{n}_{slug}.hlo.txt", "w") as f:
        f.write(meas["hlo"])
    if "error" in meas:
      rows.append({"name": name, "error": meas["error"]})
      continue
    t = meas["seconds"]
    kernels = hlo_stats.kernel_counts(meas["hlo"])
    ref = gemm_base if name.startswith("gemm") else base
    rows.append({"name": name, "ms": t * 1e3, "vs_bf16": t / ref if ref else None,
                 "TFLOP/s": flops[name] / t / 1e12, "kernels": sum(kernels.values()),
                 "gemms": hlo_stats.gemm_summary(hlo_stats.gemm_kinds(meas["hlo"])),
                 "kernel_ops": dict(kernels.most_common(6))})
  return rows


def _cell(v):
  return f"{v:.2f}" if isinstance(v, float) else ("" if v is None else str(v))


QUANT_COLUMNS = (("ms", "time (ms)"), ("GB/s", "GB/s"),
                 ("copy_fraction", "fraction of copy"), ("vs_copy", "time / negate"),
                 ("kernels", "kernels"))
LINEAR_COLUMNS = (("ms", "time (ms)"), ("vs_bf16", "/ bf16"), ("TFLOP/s", "TFLOP/s"),
                  ("kernels", "kernels"), ("gemms", "GEMMs in the optimized HLO"))


def markdown(rows, columns, title):
  """A markdown table of row dicts; columns: (key, label) pairs; `title`
  heads the name column."""
  lines = [f"| {title} | " + " | ".join(label for _, label in columns) + " |",
           "|---" * (len(columns) + 1) + "|"]
  for r in rows:
    cells = ([r["error"]] + [""] * (len(columns) - 1) if "error" in r
             else [_cell(r.get(key)) for key, _ in columns])
    lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def header(repeats):
  """One line: time, device, host processor, jax version, repeats."""
  dev = jax.devices()[0]
  return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{dev.device_kind} ({jax.default_backend()}, {jax.device_count()} devices), "
          f"{platform.processor() or platform.machine()}, jax {jax.__version__}; "
          f"fastest of {repeats}")


def run(size, linear, repeats, backends):
  """Markdown table (str) of both benchmarks."""
  on_gpu = jax.default_backend() == "gpu"
  quant = quantize_rows(size, repeats, pallas=on_gpu)
  lin = linear_rows(linear, ["mxfp4-dh16"], backends, repeats, gemm_only=on_gpu)
  m, k, n = linear
  return (header(repeats) + "\n\n"
          + markdown(quant, QUANT_COLUMNS, f"{size}x{size} bf16")
          + "\n\n" + markdown(lin, LINEAR_COLUMNS, f"fwd+bwd, M,K,N = {m},{k},{n}")
          + "\n")


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
