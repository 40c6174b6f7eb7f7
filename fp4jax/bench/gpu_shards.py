"""A sharded Dense layer through XLA's GPU compiler, without a GPU: what each device's kernels read.

  python -m fp4jax.bench gpu_shards --target h100|h200|b200 [--arms RECIPE:BACKEND,...]
      [--devices 8] [--mesh DATAxFSDPxTENSOR] [--out REPORT.json]

Compiles, for `--devices` abstract GPUs of the target (fp4jax.bench.gpu_compile's
descriptions, topology 1x1xN, autotuning off), one Dense layer's forward and
backward, x[TOKENS, K] @ w[K, N] (bf16), the tokens sharded over the mesh's
data and fsdp axes, w's K over fsdp and N over tensor (fp4jax.sharding's
rules; `--mesh`, default all devices on data), per kernel backend twice: with
the operands' specs passed to fp4jax.dot_general ("per shard": the backend runs
its kernels on each device's shard, fp4jax.shard_local) and without ("whole":
the kernels run on the whole array, as before shard_local). Per program: every kernel the
compiled HLO calls (Triton and Mosaic GPU custom calls) with its output type, every
other GEMM (fp4jax.bench.hlo_stats.gemms: XLA's dots and scaled-dots)
with its output shape and contraction, the kernels and GEMMs that see every
device's tokens (an operand, output or contraction of the global token count
TOKENS), and the collectives with the bytes they write. Needs jax's CUDA plugin
(the gpu-compile extra, Python >= 3.12); no GPU. Exits 1 when a per-shard program
holds a kernel or GEMM on the global batch.
"""

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import backends, dot, recipes, sharding
from fp4jax.bench import gpu_compile, hlo_stats

TOKENS, K, N = 3072, 512, 384
ARMS = (("bf16", "xla"), ("mxfp4", "pallas"), ("mxfp4-dh16", "pallas"), ("mxfp4", "mosaic"),
        ("mxfp4-dh16", "mosaic"), ("fp8", "mosaic"))
BATCH_AXES = ("data", "fsdp")
_KERNEL = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) custom-call\(.*?"
                     r'custom_call_target="(__gpu\$xla\.gpu\.triton|mosaic_gpu[\w]*)"')
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (all-reduce|all-gather|"
                         r"reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_DEFINED = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) [a-z][a-z0-9\-]*\(")
_OPERANDS = re.compile(r"custom-call\(([^)]*)\)")


def kernel_calls(hlo_text):
  """[(kind "triton" / "mosaic", output type text, [operand type texts])] of every
  kernel custom call (an operand defined nowhere in the text: "?")."""
  types, out = {}, []
  for line in hlo_text.splitlines():
    defined = _DEFINED.match(line)
    if defined:
      types[defined.group(1)] = defined.group(2)
    m = _KERNEL.match(line)
    if m:
      names = [a.split()[-1].lstrip("%") for a in _OPERANDS.search(line).group(1).split(", ")
               if a.strip()]
      out.append(("triton" if "triton" in m.group(3) else "mosaic", m.group(2),
                  [types.get(n, "?") for n in names]))
  return out


def shapes(type_text):
  """The dims of each array of an HLO type text ("(f8e4m3fn[384,512]{1,0}, f32[384,16]{1,0})"
  -> [[384, 512], [384, 16]])."""
  return [[int(d) for d in shape.split(",") if d] for _, shape in _ARRAY.findall(type_text)]


def dims(type_text):
  """Every array dim of an HLO type text, in one list."""
  return [d for shape in shapes(type_text) for d in shape]


def _bytes(type_text):
  """Bytes of the arrays in an HLO type text (FP8, u8, pred: 1 byte; FP4 packed: 1/2)."""
  def size(dtype):
    if dtype.startswith("f8") or dtype == "pred":
      return 1
    if dtype.startswith("f4"):
      return 0.5
    bits = re.fullmatch(r"[a-z]+(\d+)", dtype)
    return int(bits.group(1)) / 8 if bits else 1
  return int(sum(size(dtype) * int(np.prod([int(d) for d in shape.split(",") if d]))
                 for dtype, shape in _ARRAY.findall(type_text)))


def collectives(hlo_text, per_run=False):
  """{kind: (count, bytes written)} of the program's collectives (an async start's
  result holds its operands, then its outputs: the outputs are counted). per_run:
  counted as often as they run (hlo_stats.executions: a loop body's once per
  iteration), not once per instruction of the program."""
  runs = hlo_stats.executions(hlo_text) if per_run else {}
  out = collections.defaultdict(lambda: [0, 0])
  for computation, line in hlo_stats.instruction_lines(hlo_text):
    m = _COLLECTIVE.match(line)
    if not m:
      continue
    arrays = _ARRAY.findall(m.group(1))
    if m.group(3):  # an async start's result: its operands, then its outputs
      arrays = arrays[len(arrays) // 2:]
    result = " ".join(f"{d}[{s}]" for d, s in arrays)
    n = runs.get(computation, 1)
    out[m.group(2)][0] += n
    out[m.group(2)][1] += n * _bytes(result)
  return {k: tuple(v) for k, v in out.items()}


def compile_layer(devices, recipe, backend, per_shard=True, mesh_sizes=None):
  """The compiled HLO text of the Dense layer's forward + backward (module docstring);
  mesh_sizes: (data, fsdp, tensor), default all devices on data."""
  data, fsdp, tensor = mesh_sizes or (len(devices), 1, 1)
  cfg = ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))
  mesh = sharding.make_mesh(cfg, devices)
  r = dataclasses.replace(recipes.recipe(recipe), backend=backend)
  dg = dot.dot_general(r)
  x_spec, w_spec, y_spec = P(BATCH_AXES, None), P("fsdp", "tensor"), P(BATCH_AXES, "tensor")
  layer_key = jax.random.key(1) if r.needs_layer_key else None

  def layer(x, w, g, key):
    f = lambda a, b: dg(a, b, (((1,), (0,)), ((), ())), key=key, layer_key=layer_key,
                        specs=(x_spec, w_spec) if per_shard else None)
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(g)

  arg = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                                 sharding=NamedSharding(mesh, spec))
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
  outs = tuple(NamedSharding(mesh, s) for s in (y_spec, x_spec, w_spec))
  with sharding.use_mesh(mesh):
    lowered = jax.jit(layer, out_shardings=outs).lower(
        arg((TOKENS, K), x_spec), arg((K, N), w_spec), arg((TOKENS, N), y_spec), key)
    return lowered.compile(gpu_compile.COMPILE_OPTIONS).as_text()


def row(devices, recipe, backend, per_shard, mesh_sizes=None):
  """One program's report: its kernels and GEMMs, those on the global batch, its collectives."""
  text = compile_layer(devices, recipe, backend, per_shard, mesh_sizes)
  kernels = [(f"{kind} {out}", [out] + operands) for kind, out, operands in kernel_calls(text)]
  gemms = [(f"{hlo_stats.gemm_kind(g)} {g['shape']} k={g['k']}", g) for g in hlo_stats.gemms(text)
           if g["op"] != "custom-call"]  # a Mosaic GPU GEMM is one of the kernels
  return dict(recipe=recipe, backend=backend, mode="per shard" if per_shard else "whole",
              mesh="x".join(map(str, mesh_sizes or (len(devices), 1, 1))),
              kernels=[name for name, _ in kernels], gemms=[name for name, _ in gemms],
              global_batch=[name for name, types in kernels if TOKENS in dims(" ".join(types))]
              + [name for name, g in gemms if TOKENS in g["shape"] or g["k"] == TOKENS],
              collectives=collectives(text))


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench gpu_shards",
                              description=__doc__.splitlines()[0])
  p.add_argument("--target", required=True, choices=gpu_compile.TARGETS)
  p.add_argument("--arms", help="RECIPE:BACKEND,... (default: " +
                 ",".join(f"{r}:{b}" for r, b in ARMS) + ")")
  p.add_argument("--devices", type=int, default=8, help="GPUs the tokens are split over")
  p.add_argument("--mesh", default=None,
                 help="DATAxFSDPxTENSOR sizes over the devices (default: all on data), e.g. "
                      "1x8x1: the weight's K split over fsdp too")
  p.add_argument("--out", help="write the report (JSON) here")
  return p


def _arms(text, p):
  if not text:
    return ARMS
  arms = []
  for item in text.split(","):
    recipe, _, backend = item.partition(":")
    if recipe not in recipes.recipe_names() or backend not in recipes.BACKENDS:
      p.error(f"--arms: {item!r} is not RECIPE:BACKEND with a recipe of fp4jax.recipes "
              f"and a backend of {', '.join(recipes.BACKENDS)}")
    arms.append((recipe, backend))
  return tuple(arms)


def main(argv):
  p = parser()
  args = p.parse_args(argv)
  arms = _arms(args.arms, p)
  if args.devices < 2 or TOKENS % args.devices:
    p.error(f"--devices {args.devices}: must be >= 2 and divide the {TOKENS} tokens")
  mesh_sizes = None
  if args.mesh:
    try:
      mesh_sizes = tuple(int(v) for v in args.mesh.split("x"))
    except ValueError:
      mesh_sizes = ()
    if len(mesh_sizes) != 3 or np.prod(mesh_sizes) != args.devices:
      p.error(f"--mesh {args.mesh!r}: want DATAxFSDPxTENSOR multiplying to {args.devices}")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  jax.config.update("jax_platforms", "cpu")
  try:
    gpu_compile.check_arms([(r, b, None) for r, b in arms],
                           gpu_compile.target_capability(args.target), args.target)
  except ValueError as e:
    p.error(str(e))
  devices = gpu_compile.abstract_devices(args.target, args.devices)
  rows = []
  for recipe, backend in arms:
    kernels = not backends.module(backend).PARTITIONED_BY_XLA  # both ways: before and after
    for per_shard in ((False, True) if kernels else (True,)):
      rows.append(row(devices, recipe, backend, per_shard, mesh_sizes))
      r = rows[-1]
      coll = ", ".join(f"{k} {n} ({b:,} B)" for k, (n, b) in sorted(r["collectives"].items()))
      print(f"{recipe} {backend} {r['mode']} on {r['mesh']}: {len(r['kernels'])} kernels, "
            f"{len(r['gemms'])} GEMMs, "
            f"{len(r['global_batch'])} on the global batch {r['global_batch']}; "
            f"collectives: {coll or 'none'}", flush=True)
  if args.out:
    report = dict(target=args.target, devices=args.devices, tokens=TOKENS, k=K, n=N,
                  date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                  jax=jax.__version__, rows=rows)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  bad = [f"{r['recipe']} {r['backend']}" for r in rows
         if r["mode"] == "per shard" and r["global_batch"]]
  if bad:
    print(f"gpu_shards: kernels or GEMMs on the global batch in: {'; '.join(bad)}",
          file=sys.stderr)
    sys.exit(1)
