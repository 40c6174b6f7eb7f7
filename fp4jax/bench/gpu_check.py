"""The measuring stages of benchmarks/gpu_check.sh, one per call.

  python -m fp4jax.bench gpu_check STAGE --work DIR [--tiny]

STAGE:
  env       the machine: python, jax/jaxlib, devices, compute capability,
            memory, whether Pallas compiles (not interprets), and which of
            pyproject.toml's runtime and test dependencies are missing
  quantize  fused quantize and fake quantize (row, column, +-H16) against a
            copy of one [S, S] bf16 tensor (S = 23296: 1.01 GiB, so that
            launch overhead does not decide the ratio; --tiny 256)
  linear    forward+backward of one [M,K] x [K,N] bf16 layer for plain bf16
            and the fp8, mxfp4 and mxfp4-dh16 recipes on every dot_general
            backend the check runs (fp4jax.bench.gpu_plan.train_backends: all
            but `native`), at the 8B MLP shape (16384, 4096, 14336) and the
            attention shape (16384, 4096, 4096); the forward GEMM alone,
            bf16 against MXFP4 on the Hopper FP8 GEMM; the optimized HLO of
            every variant goes to DIR/hlo/ and its kernel count to the table
  native    the linear layer (the first shape) on the `native` backend for
            mxfp8, mxfp4 and nvfp4, each on its own route and forced through
            scaled_matmul and scaled_dot; per variant whether its GEMMs ran
            block-scaled (a cuDNN custom call, an HLO scaled-dot for Triton)
            or as plain dots, and TFLOP/s. Without block-scaled FP4 units
            (compute capability < 10, e.g. an H200's 9.0) it says so: XLA
            expands the block-scaled ops and the numbers are the emulation
Each writes DIR/STAGE.json and DIR/STAGE.md. The numbers are fastest-of-R
wall times of compiled executables (fp4jax.bench.kernels.measure).
"""

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
import tomllib

import jax

from fp4jax import backends, recipes
from fp4jax.bench import gpu_plan
from fp4jax.bench import kernels as bench_kernels
from fp4jax.train import throughput
from fp4jax.kernels import quantize as kq

H200_HBM_TBS = 4.8  # HBM3e bandwidth, same datasheet
QUANTIZE_SIZE = 23296  # 23296^2 bf16 = 1.01 GiB (182 x 128 rows and columns)
LINEAR_SHAPES = ((16384, 4096, 14336), (16384, 4096, 4096))
TINY_LINEAR_SHAPES = ((128, 128, 128), (128, 128, 64))
LINEAR_RECIPES = ("fp8", "mxfp4", "mxfp4-dh16")
NATIVE_RECIPES = ("mxfp8", "mxfp4", "nvfp4")
NATIVE_BACKENDS = ("native", "native:scaled_matmul", "native:scaled_dot")


def dependencies(pyproject="pyproject.toml", extras=("test",)):
  """Distribution names of the project's runtime deps and `extras`."""
  with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
  reqs = list(project["dependencies"])
  for extra in extras:
    reqs += project["optional-dependencies"][extra]
  return [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in reqs]


def package_versions(names):
  """name -> installed version, or None where it is not installed."""
  out = {}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def native_unsupported():
  """Why this device has no block-scaled FP4 units for the `native` backend, or None.

  Asks the backend's own device check (fp4jax.backends.native, which comes
  with the backend); a checkout without the backend says so.
  """
  if "native" not in recipes.BACKENDS:
    return (f"this checkout has no `native` backend "
            f"(recipes.BACKENDS = {recipes.BACKENDS})")
  try:
    from fp4jax.backends import native  # pylint: disable=g-import-not-at-top
    return native.unsupported_device()
  except (ImportError, AttributeError) as e:  # keep the other stages running
    return f"cannot ask fp4jax.backends.native.unsupported_device(): {e}"



def pallas_interprets():
  """Whether a Pallas kernel, lowered for this process's default device, is interpreted
  (no Triton call in the lowered program)."""
  from fp4jax.numerics import formats  # pylint: disable=g-import-not-at-top
  x = jax.ShapeDtypeStruct((16, 64), jax.numpy.float32)
  text = jax.jit(lambda x: kq.fake_quantize(x, formats.QuantSpec("mxfp4"))).lower(x).as_text()
  return "xla.gpu.triton" not in text


def env_stage(tiny, work):
  del tiny, work
  dev = jax.devices()[0]
  deps = package_versions(dependencies())
  others = package_versions(["jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "triton"])
  stats = dev.memory_stats() or {}
  result = dict(
      python=sys.version.split()[0], executable=sys.executable,
      machine=platform.machine(), jax=jax.__version__, backend=jax.default_backend(),
      devices=[dict(kind=d.device_kind, platform=d.platform,
                    compute_capability=getattr(d, "compute_capability", None))
               for d in jax.devices()],
      memory_limit_gib=stats.get("bytes_limit", 0) / 2**30 or None,
      pallas_interprets=pallas_interprets(),
      native_unsupported=native_unsupported(),
      xla_flags=os.environ.get("XLA_FLAGS", ""), packages={**deps, **others},
      missing=[name for name, v in deps.items() if v is None])
  lines = [f"- {k}: {v}" for k, v in result.items() if k != "packages"]
  lines += ["", "| package | version |", "|---|---|"]
  lines += [f"| {k} | {v or 'MISSING'} |" for k, v in deps.items()]
  lines += [f"| {k} | {v or 'not installed'} |" for k, v in others.items()]
  return result, "\n".join(lines)


def quantize_stage(tiny, work):
  del work
  size, repeats = (256, 2) if tiny else (QUANTIZE_SIZE, 20)
  rows = bench_kernels.quantize_rows(size, repeats, pallas=True)
  copy = next((r for r in rows if r["name"] == "negate (copy)" and "GB/s" in r), None)
  note = ""
  if copy and jax.default_backend() == "gpu":
    note = (f"\n\ncopy: {copy['GB/s']:.0f} GB/s = "
            f"{copy['GB/s'] / 1e3 / H200_HBM_TBS:.2f} of the H200's {H200_HBM_TBS} TB/s")
  md = (bench_kernels.header(repeats) + "\n\n"
        + bench_kernels.markdown(rows, bench_kernels.QUANT_COLUMNS, f"{size}x{size} bf16")
        + note)
  return {"size": size, "repeats": repeats, "rows": rows}, md


def _linear_tables(shapes, recipe_names, backend_names, repeats, work, gemm_only):
  hlo_dir = os.path.join(work, "hlo")
  os.makedirs(hlo_dir, exist_ok=True)
  tables, mds = [], []
  for shape in shapes:
    rows = bench_kernels.linear_rows(shape, recipe_names, backend_names, repeats,
                                     gemm_only=gemm_only, hlo_dir=hlo_dir)
    for r in rows:
      if "TFLOP/s" in r:
        r["fraction_of_bf16_peak"] = r["TFLOP/s"] / throughput.PEAK_BF16_TFLOPS["H200"]
    tables.append({"shape": list(shape), "rows": rows})
    mds.append(bench_kernels.markdown(
        rows, bench_kernels.LINEAR_COLUMNS + (("fraction_of_bf16_peak", "of 989 TF"),),
        "fwd+bwd, M,K,N = {},{},{}".format(*shape)))
  return tables, mds


def linear_stage(tiny, work, backend_names=None, gemm_only=True):
  shapes, repeats = (TINY_LINEAR_SHAPES, 2) if tiny else (LINEAR_SHAPES, 10)
  cc = getattr(jax.devices()[0], "compute_capability", None)
  backend_names = backend_names or gpu_plan.train_backends(cc)[0]
  tables, mds = _linear_tables(shapes, LINEAR_RECIPES, backend_names, repeats, work,
                               gemm_only)
  return ({"repeats": repeats, "tables": tables},
          bench_kernels.header(repeats) + "\n\n" + "\n\n".join(mds))


def native_stage(tiny, work):
  """The native backend's GEMM kinds and speed by format and route (module docstring)."""
  try:
    backends.check_jax("native")
  except ValueError as e:
    return {"skipped": str(e)}, f"skipped: {e}"
  shapes, repeats = (TINY_LINEAR_SHAPES[:1], 2) if tiny else (LINEAR_SHAPES[:1], 10)
  tables, mds = _linear_tables(shapes, NATIVE_RECIPES, NATIVE_BACKENDS, repeats, work, False)
  why_not = native_unsupported()
  note = ("block-scaled FP4 units: yes" if why_not is None else
          f"no block-scaled FP4 units ({why_not}): XLA expands the block-scaled ops "
          "into dequantize + dot, so these numbers measure the emulation")
  return ({"repeats": repeats, "tables": tables, "fp4_units": why_not is None, "note": note},
          bench_kernels.header(repeats) + "\n\n" + note + "\n\n" + "\n\n".join(mds))


STAGES = {"env": env_stage, "quantize": quantize_stage, "linear": linear_stage,
          "native": native_stage}


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench gpu_check",
                              description=__doc__.splitlines()[0])
  p.add_argument("stage", choices=sorted(STAGES))
  p.add_argument("--work", required=True, help="directory for STAGE.json and STAGE.md")
  p.add_argument("--tiny", action="store_true", help="CPU dry-run sizes")
  return p


def main(argv):
  args = parser().parse_args(argv)
  os.makedirs(args.work, exist_ok=True)
  result, md = STAGES[args.stage](args.tiny, args.work)
  with open(os.path.join(args.work, f"{args.stage}.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(os.path.join(args.work, f"{args.stage}.md"), "w") as f:
    f.write(md + "\n")
  print(md)
