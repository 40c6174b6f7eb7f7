"""The same quantizations on two JAX backends and two dot_general backends, bit for bit.

  JAX_PLATFORMS=cpu python -m fp4jax.bench crosscheck --save ref.npz
  python -m fp4jax.bench crosscheck --against ref.npz --out crosscheck  # on the GPU

The first command runs every XLA case on the CPU and saves the output bits;
the second runs the same cases on the default backend (the GPU) with the
`xla` path and with the Pallas kernels, and counts differing elements:
  pallas vs xla      on the same device: the kernels' contract is 0
  xla vs xla CPU     XLA:GPU against XLA:CPU (flush-to-zero of subnormals,
                     NaN handling, fused or reordered float arithmetic)
per class of input row (CLASSES), so a difference confined to subnormal or
NaN rows shows as such. The dot_general cases (forward and both gradients of
one layer) also report the largest relative difference: across devices the
GEMMs sum in different orders, so their bits are not expected to agree.
Inputs come from NumPy's generator, identical in both processes. Writes
OUT.json and OUT.md.
"""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import dot, recipes
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.kernels import quantize as kq

CLASSES = ("normal", "nan", "inf", "zero block", "ties", "f32 subnormal",
           "tiny (2^-120)", "near overflow")
SCALE_MODES = ("floor", "even", "rceil")
DOT_RECIPES = ("fp8", "mxfp4", "mxfp4-sr", "mxfp4-dh16")
_DIMS = (((1,), (0,)), ((), ()))


def inputs(rows_per_class, n, seed=0):
  """(x float32 [len(CLASSES) * rows_per_class, n], class index of each row)."""
  rng = np.random.default_rng(seed)
  r = rows_per_class
  normal = lambda: rng.standard_normal((r, n)) * np.exp2(rng.integers(-12, 12, (r, n)))
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # 6: pins the scale
  blocks = []
  for cls in CLASSES:
    x = normal()
    if cls == "nan":
      x[np.arange(r), rng.integers(0, n, r)] = np.nan
    elif cls == "inf":
      x[np.arange(r), rng.integers(0, n, r)] = np.where(rng.random(r) < 0.5, np.inf, -np.inf)
    elif cls == "zero block":
      x[:, :32] = 0.0
    elif cls == "ties":
      x = np.resize(ties, (r, n)) * np.exp2(rng.integers(-8, 8, (r, 1)))
    elif cls == "f32 subnormal":
      x = rng.standard_normal((r, n)) * 1e-40
    elif cls == "tiny (2^-120)":
      x = rng.standard_normal((r, n)) * 2.0 ** -120
    elif cls == "near overflow":
      x = rng.standard_normal((r, n)) * 1e37
    blocks.append(x.astype(np.float32))
  return np.concatenate(blocks), np.repeat(np.arange(len(CLASSES)), r)


def _rows_first(fn):
  """fn(x [n, R], axis=0) as a function of x [R, n], outputs transposed back."""
  return lambda x: tuple(o.T for o in fn(x.T, 0))


def quantize_cases():
  """name -> (xla fn, pallas fn): x [R, n] -> tuple of arrays with rows first."""
  cases = {}
  for dtype in ("float32", "bfloat16"):
    for mode in SCALE_MODES:
      spec = formats.QuantSpec("mxfp4", scale_mode=mode)
      for axis in (-1, 0):
        def xla(x, a, spec=spec):
          q = formats.quantize(x, spec, a)
          return formats.pack_fp4(q.values, a), q.scales
        pallas = lambda x, a, spec=spec: kq.quantize_packed(x, spec, a)
        cases[f"quantize {mode} {dtype} axis {axis}"] = (dtype, axis, xla, pallas)
    spec = formats.QuantSpec("mxfp4")
    for axis in (-1, 0):
      xla = lambda x, a, spec=spec: (formats.fake_quantize(hadamard.rotate(x, 16, a), spec, a),)
      pallas = lambda x, a, spec=spec: (kq.fake_quantize(x, spec, a, hadamard_block=16),)
      cases[f"fake_quantize H16 {dtype} axis {axis}"] = (dtype, axis, xla, pallas)
  sr = formats.QuantSpec("mxfp4", rounding="stochastic")
  key = jax.random.key(5)
  cases["fake_quantize stochastic bfloat16 axis 0"] = (
      "bfloat16", 0, lambda x, a: (formats.fake_quantize(x, sr, a, key),),
      lambda x, a: (kq.fake_quantize(x, sr, a, key=key),))
  e4m3 = formats.QuantSpec("mxfp8_e4m3", scale_mode="rceil")
  cases["fake_quantize mxfp8_e4m3 bfloat16 axis -1"] = (
      "bfloat16", -1, lambda x, a: (formats.fake_quantize(x, e4m3, a),),
      lambda x, a: (kq.fake_quantize(x, e4m3, a),))
  out = {}
  for name, (dtype, axis, xla, pallas) in cases.items():
    def wrap(fn, dtype=dtype, axis=axis):
      if axis == 0:
        return jax.jit(lambda x: _rows_first(fn)(x.astype(dtype)))
      return jax.jit(lambda x: fn(x.astype(dtype), -1))
    out[name] = (wrap(xla), wrap(pallas))
  return out


def dot_cases():
  """name -> (xla fn, pallas fn): (x, w, dy) -> (y, dx, dw) of one layer."""
  out = {}
  for name in DOT_RECIPES:
    fns = []
    for backend in ("xla", "pallas"):
      dg = dot.dot_general(dataclasses.replace(recipes.recipe(name), backend=backend))
      def step(x, w, dy, dg=dg):
        y, vjp = jax.vjp(lambda a, b: dg(a, b, _DIMS, key=jax.random.key(3)), x, w)
        return (y,) + vjp(dy)
      fns.append(jax.jit(step))
    out[f"dot_general fwd+bwd {name}"] = tuple(fns)
  return out


def dot_inputs(m, k, n, seed=1):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((m, k)).astype(np.float32),
          (rng.standard_normal((k, n)) / k ** 0.5).astype(np.float32),
          rng.standard_normal((m, n)).astype(np.float32))


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def compare(got, want, row_class=None):
  """Counts of differing elements between two arrays of one shape and dtype.

  Bits are compared; NaNs count as equal to NaNs whatever their payload
  (counted apart as nan_payload). row_class: class index of each row (axis 0).
  """
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape or got.dtype != want.dtype:
    return {"error": f"{got.shape} {got.dtype} vs {want.shape} {want.dtype}"}
  out = {"elements": int(got.size)}
  if got.dtype.kind in "ui":
    differ = got != want
  else:
    gf, wf = got.astype(np.float32), want.astype(np.float32)
    nan_g, nan_w = np.isnan(gf), np.isnan(wf)
    both_nan = nan_g & nan_w
    differ = (_bits(got) != _bits(want)) & ~both_nan
    out["nan_payload"] = int(np.sum(both_nan & (_bits(got) != _bits(want))))
    finite = np.isfinite(gf) & np.isfinite(wf)
    scale = max(float(np.max(np.abs(wf[finite]), initial=0.0)), 1e-30)
    out["max_rel_diff"] = float(np.max(np.abs(gf[finite] - wf[finite]), initial=0.0)) / scale
  out["mismatched"] = int(np.sum(differ))
  if row_class is not None and out["mismatched"]:
    per_row = differ.reshape(differ.shape[0], -1).sum(axis=1)
    out["by_class"] = {CLASSES[c]: int(per_row[row_class == c].sum())
                       for c in np.unique(row_class) if per_row[row_class == c].sum()}
  return out


def _merge(results):
  """One summary of several per-output compare() dicts."""
  if any("error" in r for r in results):
    return {"error": "; ".join(r["error"] for r in results if "error" in r)}
  out = {"elements": sum(r["elements"] for r in results),
         "mismatched": sum(r["mismatched"] for r in results)}
  if any("max_rel_diff" in r for r in results):
    out["max_rel_diff"] = max(r.get("max_rel_diff", 0.0) for r in results)
    out["nan_payload"] = sum(r.get("nan_payload", 0) for r in results)
  by = {}
  for r in results:
    for c, v in r.get("by_class", {}).items():
      by[c] = by.get(c, 0) + v
  if by:
    out["by_class"] = by
  return out


def _run(fn, args):
  try:
    return [np.asarray(o) for o in jax.block_until_ready(fn(*args))]
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _all_cases(rows_per_class, n, linear):
  x, row_class = inputs(rows_per_class, n)
  cases = {k: (fns, (x,), row_class) for k, fns in quantize_cases().items()}
  cases.update({k: (fns, dot_inputs(*linear), None) for k, fns in dot_cases().items()})
  return cases


def save_reference(path, rows_per_class, n, linear):
  """Runs every case's XLA function here; saves bits and dtype names to `path`."""
  arrays = {}
  for name, ((xla, _), args, _) in _all_cases(rows_per_class, n, linear).items():
    outs = _run(xla, args)
    if isinstance(outs, str):
      arrays[f"{name}|error"] = np.array(outs)
      continue
    for i, o in enumerate(outs):
      arrays[f"{name}|{i}|{o.dtype.name}"] = _bits(o)
  np.savez_compressed(path, **arrays)


def _load_reference(path):
  ref = {}
  with np.load(path) as f:
    for key in f.files:
      parts = key.split("|")
      if parts[1] == "error":
        ref[parts[0]] = str(f[key])
        continue
      ref.setdefault(parts[0], []).append(f[key].view(jnp.dtype(parts[2])))
  return ref


def check(reference, rows_per_class, n, linear):
  """One dict per case: pallas vs xla here, xla here vs the reference file's."""
  ref = _load_reference(reference) if reference else {}
  rows = []
  for name, ((xla, pallas), args, row_class) in _all_cases(rows_per_class, n, linear).items():
    here, kern = _run(xla, args), _run(pallas, args)
    row = {"case": name}
    for label, got, want in (("pallas vs xla", kern, here),
                             ("xla vs reference", here, ref.get(name)),
                             ("pallas vs reference", kern, ref.get(name))):
      if want is None:
        continue
      if isinstance(got, str) or isinstance(want, str):
        row[label] = {"error": got if isinstance(got, str) else f"reference: {want}"}
      else:
        row[label] = _merge([compare(g, w, row_class) for g, w in zip(got, want)])
    rows.append(row)
  return rows


def _cell(r):
  if r is None:
    return ""
  if "error" in r:
    return r["error"]
  text = f"{r['mismatched']} / {r['elements']}"
  if r.get("by_class"):
    text += " (" + ", ".join(f"{c}: {v}" for c, v in r["by_class"].items()) + ")"
  if r.get("max_rel_diff"):
    text += f"; max rel diff {r['max_rel_diff']:.2e}"
  if r.get("nan_payload"):
    text += f"; NaN payloads {r['nan_payload']}"
  return text


def markdown(rows, reference_name):
  labels = ("pallas vs xla", "xla vs reference", "pallas vs reference")
  head = ("| case (differing elements / elements) | pallas vs xla, same device | "
          f"xla vs xla on {reference_name} | pallas vs xla on {reference_name} |")
  lines = [head, "|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['case']} | " + " | ".join(_cell(r.get(l)) for l in labels) + " |")
  return "\n".join(lines)


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench crosscheck",
                              description=__doc__.splitlines()[0])
  p.add_argument("--save", help="run the XLA cases here and save their bits (.npz)")
  p.add_argument("--against", help="the .npz another backend saved")
  p.add_argument("--out", help="write OUT.json and OUT.md")
  p.add_argument("--rows", type=int, default=32, help="rows per input class")
  p.add_argument("--n", type=int, default=1024, help="row length (a multiple of 32)")
  p.add_argument("--linear", default="256,512,256", help="M,K,N of the dot_general cases")
  return p


def main(argv):
  args = parser().parse_args(argv)
  linear = tuple(int(v) for v in args.linear.split(","))
  if args.save:
    save_reference(args.save, args.rows, args.n, linear)
    print(f"crosscheck: saved {jax.devices()[0].device_kind} bits to {args.save}")
    return
  rows = check(args.against, args.rows, args.n, linear)
  table = markdown(rows, "the reference (XLA:CPU)")
  print(table)
  if args.out:
    with open(args.out + ".json", "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "reference": args.against, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
      f.write(table + "\n")
