"""Every GPU path of fp4jax through XLA's GPU compiler, on a machine without a GPU.

  python -m fp4jax.bench gpu_compile --target h100|h200|b200 [--what linear,kernels,...]
      [--arms RECIPE:BACKEND[:ROUTE],...] [--out REPORT.json] [--against REPORT.json]
      [--no-sass]

Needs jax's CUDA plugin (`pip install -e ".[gpu-compile]"`, Python >= 3.12);
no GPU. The target's device description (fp4jax/bench/gpu_targets/NAME.txtpb)
gives an abstract device (jax.experimental.topologies), and each program is
jitted with shardings on it and compiled by XLA's real GPU pipeline, Triton
and ptxas included, with autotuning off (`xla_gpu_autotune_level=0`: nothing
can be timed without the device, so every GEMM fusion keeps XLA's default
tile configuration). `--target device` compiles the same programs for the
GPU this process runs on (same options), and `--against` prints how that
differs from a deviceless report.

Programs (`--what`, default all):
  linear     one Dense layer x[256, 512] @ w[512, 384] (bf16), forward and
             backward (jax.vjp with a cotangent argument), per recipe and backend
             (LINEAR_ARMS); per role (Fprop, Dgrad, Wgrad, by output shape) the
             GEMM it became and the element types the GEMM reads
  kernels    every Pallas kernel as the pallas backend calls it (KERNELS)
  step-tiny, step-125m  the trainer's jitted train step of configs/default.py
             and configs/ablation_gpu.py, per STEP_ARMS
  step-125m-scanned  the same 125M step with its blocks under nn.scan
             (model.scan_layers: one block to compile, not 12)
  block-8b   one Llama 3.1-8B block (remat full, bf16) forward and backward on
             2 x 8192 tokens (one device's micro-batch of configs/llama3_8b_c4.py)
`--arms` keeps only the listed arms of each program (linear, steps, block):
each RECIPE:BACKEND or RECIPE:native:ROUTE (ROUTE one of
fp4jax.backends.NATIVE_ROUTES), once. Before anything compiles, each arm is
checked against the installed jax (fp4jax.backends.check_jax) and the
target's compute capability (read from its description, or the device's):
a backend module's CAPABILITY_MAJOR names the only GPUs it compiles for
(`mosaic`: Hopper, 9.x). What is refused exits 2 with one line naming it.
For every program: compiled or the one-line error, the seconds to lower and
compile it, the CPU seconds this process (and its children) spent in them (a
measure a loaded machine changes less) and the machine's load average (1, 5,
15 min) when it finished, its
size (lines of the lowered StableHLO, kernels of the compiled program:
fp4jax.bench.hlo_stats.kernel_counts, its fusions by kind), its GEMMs by kind
(fp4jax.bench.hlo_stats.gemms), the tensor-core instructions of each GEMM
kernel read from the compiled binary (fp4jax.bench.gpu_binary; --no-sass
skips it) and the memory the program needs: arguments + outputs + temporaries
- aliased bytes (XLA's buffer assignment). The JSON report (--out, rewritten
after each program, so an interrupted run keeps what it finished) records the
date, the git commit, the jax versions and the CPU count. Exits 1 naming what
failed to compile.
"""

import argparse
import collections
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import backends, dot, recipes, sharding
from fp4jax.bench import gpu_binary, hlo_stats
from fp4jax.data import tokenizers
from fp4jax.llama import model as model_lib
from fp4jax.train import cli
from fp4jax.train import config as train_config
from fp4jax.train import atomic
from fp4jax.train import step as train_step

TARGETS = ("h100", "h200", "b200")
TARGET_DIR = os.path.join(os.path.dirname(__file__), "gpu_targets")
COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0}
M, K, N = 256, 512, 384
ROLES = {(M, N): "fprop", (M, K): "dgrad", (K, N): "wgrad"}
# (recipe, backend, native_route or None): bf16 and per-tensor fp8 run on xla
# whatever the backend; MXFP4 through scaled_matmul and MXFP8 through scaled_dot are
# the routes fp4jax does not take by default (fp4jax.backends.native.route_for).
LINEAR_ARMS = (("bf16", "xla", None), ("fp8", "xla", None),
               ("mxfp8", "xla", None), ("mxfp8", "pallas", None), ("mxfp8", "native", None),
               ("mxfp8", "native", "scaled_dot"),
               ("mxfp4", "xla", None), ("mxfp4", "pallas", None), ("mxfp4", "native", None),
               ("mxfp4", "native", "scaled_matmul"),
               ("mxfp4-dh16", "xla", None), ("mxfp4-dh16", "pallas", None),
               ("mxfp4-dh16", "native", None), ("nvfp4", "xla", None), ("nvfp4", "native", None))
STEP_ARMS = (("bf16", "xla", None), ("fp8", "xla", None), ("mxfp4-dh16", "xla", None),
             ("mxfp4-dh16", "pallas", None), ("mxfp4-dh16", "native", None),
             ("nvfp4", "native", None))
# program -> (config file, scan_layers)
STEP_CONFIGS = {"step-tiny": ("configs/default.py", False),
                "step-125m": ("configs/ablation_gpu.py", False),
                "step-125m-scanned": ("configs/ablation_gpu.py", True)}
PROGRAMS = ("linear", "kernels", "step-tiny", "step-125m", "step-125m-scanned", "block-8b")
BLOCK_TOKENS = (2, 8192)
_FUSION_KIND = re.compile(r" fusion\(.*?kind=(k\w+)")


@dataclasses.dataclass
class Row:
  """One compiled program of the report (JSON-ready through dataclasses.asdict)."""
  program: str
  recipe: str
  backend: str
  compiled: bool = False
  error: str | None = None
  seconds: float = 0.0
  cpu_seconds: float = 0.0  # CPU time of this process and its children in those seconds
  memory_mib: float | None = None
  load_avg: tuple | None = None  # os.getloadavg() when the compile ended
  lowered_lines: int = 0  # lines of the lowered StableHLO module
  kernels: int = 0  # kernels the compiled program launches (hlo_stats.kernel_counts)
  fusion_kinds: dict = dataclasses.field(default_factory=dict)  # fusions in the module by kind
  gemms: list = dataclasses.field(default_factory=list)  # hlo_stats.gemms + role, mma
  triton_calls: int = 0  # Pallas kernels compiled by Triton (__gpu$xla.gpu.triton)
  pallas_mma: dict | None = None  # "kernels" rows: SASS matrix instructions of the kernel
  sass_error: str | None = None


def target_description(target):
  """The text of a committed target's description (gpu_targets/TARGET.txtpb)."""
  with open(os.path.join(TARGET_DIR, f"{target}.txtpb")) as f:
    return f.read()


def target_capability(target):
  """(major, minor) compute capability of a committed target's description
  (gpu_targets/TARGET.txtpb), read without the CUDA plugin."""
  found = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s+minor:\s*(\d+)",
                    target_description(target))
  if found is None:
    raise ValueError(f"{target}.txtpb names no cuda_compute_capability")
  return int(found.group(1)), int(found.group(2))


def check_arms(arms, capability, target):
  """Raises ValueError (one line) for the first arm whose backend the installed
  jax cannot run, or that does not compile for compute capability `capability`
  ((major, minor) of `target`, a name of TARGETS or the device): a backend
  module's CAPABILITY_MAJOR. `auto` picks by the device this process runs on, so
  it is refused for a target without one."""
  for name, backend, route in arms:
    arm = ":".join(x for x in (name, backend, route) if x)
    if backend == "auto":
      if target in TARGETS:
        raise ValueError(f"arm {arm!r}: backend auto picks by this process's device, "
                         f"and target {target} has none; name the backend "
                         f"({', '.join(backends.NAMES)})")
      continue
    major = getattr(backends.module(backend), "CAPABILITY_MAJOR", None)
    if major is not None and capability[0] != major:
      raise ValueError(f"arm {arm!r}: {backend} is for compute capability {major}.x only "
                       f"({'Hopper' if major == 9 else 'its GPUs'}); target {target} is "
                       f"{capability[0]}.{capability[1]}")
    try:
      backends.check_jax(backend)
      if route:
        backends.check_native_route(route)
    except ValueError as e:
      raise ValueError(f"arm {arm!r}: {e}") from None


def target_devices(target):
  """The devices to compile for: the abstract `target` GPU, or this process's GPU."""
  if target == "device":
    if jax.default_backend() != "gpu":
      raise SystemExit(f"gpu_compile: --target device needs a GPU; this process has "
                       f"{jax.default_backend()!r} devices")
    return jax.devices()[:1]
  return abstract_devices(target)


def abstract_devices(target, count=1, hosts=1):
  """`count` compile-only GPUs of a committed target on `hosts` hosts (count / hosts
  each, the later hosts' devices after the earlier's): jax.experimental.topologies
  with the target's description and topology 1 x hosts x (count / hosts)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc("fp4jax", "cuda", target_config=target_description(target),
                                      topology=f"1x{hosts}x{count // hosts}").devices


def one_line(error):
  lines = [l for l in str(error).strip().splitlines() if l.strip()]
  text = lines[-1] if lines else type(error).__name__
  return f"{type(error).__name__}: {text}"[:300]


def compile_row(row, build, mesh, sass=True):
  """Fills `row` from build() -> jax Lowered, compiled for the mesh's device."""
  start, cpu = time.perf_counter(), _cpu_seconds()
  try:
    with sharding.use_mesh(mesh):
      lowered = build()
      compiled = lowered.compile(COMPILE_OPTIONS)
  except Exception as e:  # pylint: disable=broad-except  (reported, the rest goes on)
    row.error, row.seconds = one_line(e), time.perf_counter() - start
    row.cpu_seconds, row.load_avg = _cpu_seconds() - cpu, os.getloadavg()
    print(f"gpu_compile: {row.program} {row.recipe} {row.backend}: {row.error}",
          file=sys.stderr, flush=True)
    return row
  row.compiled, row.seconds = True, time.perf_counter() - start
  row.cpu_seconds, row.load_avg = _cpu_seconds() - cpu, os.getloadavg()
  row.lowered_lines = lowered.as_text().count("\n")
  stats = compiled.memory_analysis()
  if stats is not None:
    row.memory_mib = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                      + stats.temp_size_in_bytes - stats.alias_size_in_bytes) / 2**20
  text = compiled.as_text()
  row.kernels = sum(hlo_stats.kernel_counts(text).values())
  row.fusion_kinds = dict(collections.Counter(_FUSION_KIND.findall(text)))
  row.triton_calls = text.count('custom_call_target="__gpu$xla.gpu.triton"')
  row.gemms = hlo_stats.gemms(text)
  for g in row.gemms:
    g["kind"] = hlo_stats.gemm_kind(g)
    g["role"] = (ROLES.get(tuple(d for d in g["shape"] if d in (M, K, N)))
                 if row.program == "linear" and g["kind"] != "rotation" else None)
  if sass:
    _add_sass(row, compiled)
  print(f"gpu_compile: {row.program} {row.recipe} {row.backend}: {_status(row)}",
        file=sys.stderr, flush=True)
  return row


def _cpu_seconds():
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def _add_sass(row, compiled):
  """Each GEMM's kernel's SASS matrix instructions, one disassembly per distinct GEMM."""
  try:
    images = {gpu_binary.kernel_name(i): i for i in gpu_binary.cubins(compiled)}
    images.pop(None, None)
    if not images:  # jax 0.11.2's serialized executables held none
      row.sass_error = f"no kernel binaries in jax {jax.__version__}'s serialized executable"
      return
    seen = {}
    for g in row.gemms:
      name = (g["kernel"] or "").replace(".", "_").replace("-", "_")  # as the cubin names it
      signature = (g["kind"], tuple(g["operands"]), tuple(g["shape"]), g["kernel_kind"])
      if signature not in seen and name in images:
        seen[signature] = dict(gpu_binary.sass_mma(images[name]))
      g["mma"] = seen.get(signature)
    if row.program == "kernels":
      row.pallas_mma = dict(sum((gpu_binary.sass_mma(i) for n, i in images.items()
                                 if n and n.startswith("fp4jax_")), collections.Counter()))
  except Exception as e:  # pylint: disable=broad-except
    row.sass_error = one_line(e)


def _key(sharding_):
  """An abstract PRNG key with `sharding_` (a concrete key would live on the CPU)."""
  key = jax.eval_shape(lambda: jax.random.key(0))
  return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding_)


def _recipe(name, backend, route):
  r = dataclasses.replace(recipes.recipe(name), backend=backend)
  return dataclasses.replace(r, native_route=route) if route else r


def _label(backend, route):
  return backend if route is None else f"{backend}:{route}"


def linear_rows(mesh, sass, arms=LINEAR_ARMS):
  """The Dense layer's forward + backward per arm (module docstring)."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=replicated)
  rows = []
  for name, backend, route in arms:
    recipe = _recipe(name, backend, route)
    dg = dot.dot_general(recipe)
    layer_key = jax.random.key(1) if recipe.needs_layer_key else None

    def layer(x, w, g, key, dg=dg, layer_key=layer_key):
      y, vjp = jax.vjp(lambda a, b: dg(a, b, (((1,), (0,)), ((), ())), key=key,
                                        layer_key=layer_key), x, w)
      return (y,) + vjp(g)

    build = lambda layer=layer: jax.jit(layer, out_shardings=replicated).lower(
        bf16(M, K), bf16(K, N), bf16(M, N), _key(replicated))
    rows.append(compile_row(Row("linear", name, _label(backend, route)), build, mesh, sass))
  return rows


def kernel_rows(mesh, sass):
  """Every Triton kernel of fp4jax.kernels as the pallas backend (and, for quantize_fp8,
  the mosaic backend) call it."""
  from fp4jax.kernels import quantize as kq  # pylint: disable=g-import-not-at-top
  from fp4jax.numerics import formats  # pylint: disable=g-import-not-at-top
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
  x = arg((M, K), jnp.bfloat16)
  rows = []
  for kernel in ("quantize_packed", "fake_quantize"):
    for axis in (-1, 0):
      for block in (None, 16):
        for rounding in ("nearest", "stochastic"):
          spec = formats.QuantSpec("mxfp4", rounding=rounding)
          bits = arg((M, K), jnp.uint32) if spec.is_random else None
          fn = getattr(kq, kernel)
          call = lambda x, b, fn=fn, spec=spec, axis=axis, block=block: fn(
              x, spec, axis, hadamard_block=block, random_bits=b)
          label = f"{kernel} axis={axis} h={block or '-'} {rounding}"
          build = lambda call=call, bits=bits: jax.jit(call, out_shardings=replicated).lower(x, bits)
          rows.append(compile_row(Row("kernels", label, "pallas"), build, mesh, sass))
  spec = formats.QuantSpec("mxfp4")
  for axis in (-1, 0):  # the blocked axis written last: a column tile transposed in the kernel
    call = lambda x, axis=axis: kq.quantize_fp8(x, spec, axis)
    build = lambda call=call: jax.jit(call, out_shardings=replicated).lower(x)
    rows.append(compile_row(Row("kernels", f"quantize_fp8 axis={axis}", "mosaic"), build, mesh,
                            sass))
  return rows


def step_rows(program, mesh_devices, sass, arms=STEP_ARMS):
  """The trainer's train step of STEP_CONFIGS[program] per arm."""
  from fp4jax.bench import train_speed  # pylint: disable=g-import-not-at-top
  path, scan_layers = STEP_CONFIGS[program]
  rows = []
  for name, backend, route in arms:
    config = train_speed.run_config(cli.load_config_file(path), name, backend, steps=1,
                                    scan_layers=scan_layers)
    if route:
      config.quant.native_route = route
    tokenizer = tokenizers.make_tokenizer(config.data.tokenizer)
    model_cfg, recipe = train_config.resolve(config, tokenizer)
    mesh = sharding.make_mesh(config.mesh, mesh_devices)
    programs = train_step.make_programs(config, model_cfg, recipe, mesh)
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                                  sharding=sharding.batch_sharding(mesh))
    build = lambda programs=programs, tokens=tokens: programs.step.lower(programs.abstract, tokens)
    rows.append(compile_row(Row(program, name, _label(backend, route)), build, mesh, sass))
  return rows


def block_rows(mesh_devices, sass, arms=STEP_ARMS):
  """One Llama 3.1-8B block forward + backward per arm (module docstring)."""
  cfg = model_lib.model_config("llama3.1-8b", dtype="bfloat16", remat="full")
  mesh = sharding.make_mesh(train_config.base_config().mesh, mesh_devices)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct(BLOCK_TOKENS + (cfg.dim,), jnp.bfloat16, sharding=replicated)
  rows = []
  for name, backend, route in arms:
    block = model_lib.Block(cfg, _recipe(name, backend, route))
    rngs = lambda key: {"params": key, "quant": key, "hadamard": key}

    def fwd_bwd(params, x, g, key, block=block):
      apply = lambda p, h: block.apply(p, h, rngs=rngs(key))[0]
      _, vjp = jax.vjp(apply, params, x)
      return vjp(g)

    # Abstract parameters, outside the mesh (whose logical constraints need sharded inputs).
    params = nn.unbox(jax.eval_shape(lambda k, h, block=block: block.init(rngs(k), h),
                                     _key(replicated), x))
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated),
                          params)
    build = lambda fwd_bwd=fwd_bwd, params=params: jax.jit(
        fwd_bwd, out_shardings=replicated).lower(params, x, x, _key(replicated))
    rows.append(compile_row(Row("block-8b", name, _label(backend, route)), build, mesh, sass))
  return rows


def _gemm_cell(g, sass=True):
  """'block-scaled (scaled-dot) in triton_nested_gemm_fusion (f4e2m1fn x f4e2m1fn):
  UTCOMMA' for one GEMM (sass=False: without the SASS instructions)."""
  kind = g["kind"]
  if g.get("kernel_kind") and g["op"] != "custom-call":
    kind += f" in {g['kernel_kind'].strip('_')}"
  mma = g.get("mma") if sass else None
  sass = "" if mma is None else ": " + (" ".join(sorted(mma)) or "no MMA")
  return f"{kind} ({' x '.join(g['operands'])}){sass}"


def markdown(rows):
  """The report's tables, one per program kind."""
  out = []
  linear = [r for r in rows if r.program == "linear"]
  if linear:
    out += ["| recipe | backend | compiled | Fprop | Dgrad | Wgrad | other GEMMs | MiB |",
            "|---|---|---|---|---|---|---|---|"]
    for r in linear:
      roles = {role: "; ".join(_gemm_cell(g) for g in r.gemms if g.get("role") == role)
               for role in ("fprop", "dgrad", "wgrad")}
      others = collections.Counter(g["kind"] for g in r.gemms if not g.get("role"))
      out.append(f"| {r.recipe} | {r.backend} | {_status(r)} | {roles['fprop']} | "
                 f"{roles['dgrad']} | {roles['wgrad']} | {_counts(others)} | {_mib(r)} |")
  others = [r for r in rows if r.program != "linear"]
  if others:
    out += ["", "| program | recipe | backend | compiled | Triton kernels | GEMMs | "
            "SASS matrix instructions | MiB | kernels | lowered lines | load (1, 5, 15 min) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in others:
      kinds = collections.Counter(g["kind"] for g in r.gemms)
      mma = collections.Counter(r.pallas_mma or {})
      for g in r.gemms:
        mma.update(g.get("mma") or {})
      out.append(f"| {r.program} | {r.recipe} | {r.backend} | {_status(r)} | {r.triton_calls} | "
                 f"{_counts(kinds)} | {_counts(mma) or '-'} | {_mib(r)} | {r.kernels} | "
                 f"{r.lowered_lines} | {_load(r)} |")
  return "\n".join(out)


def _status(row):
  if not row.compiled:
    return f"NO: {row.error}"
  sass = f" (SASS not read: {row.sass_error})" if row.sass_error else ""
  return f"yes, {row.seconds:.0f} s ({row.cpu_seconds:.0f} s CPU){sass}"


def _counts(counter):
  return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()))


def _load(row):
  return "" if row.load_avg is None else ", ".join(f"{v:.1f}" for v in row.load_avg)


def _mib(row):
  return "" if row.memory_mib is None else f"{row.memory_mib:,.0f}"


def differences(report, other):
  """Lines saying how `report` differs from `other` (two reports' dicts), row by row:
  compiled or not, and each GEMM's kind, operand types and SASS instructions (these
  only where both reports read every GEMM kernel's)."""
  key = lambda r: (r["program"], r["recipe"], r["backend"])
  theirs = {key(r): r for r in other["rows"]}
  lines = []
  for r in report["rows"]:
    o = theirs.get(key(r))
    if o is None:
      lines.append(f"{key(r)}: not in the other report")
      continue
    if r["compiled"] != o["compiled"]:
      lines.append(f"{key(r)}: compiled {r['compiled']} here, {o['compiled']} there "
                   f"({r['error'] or o['error']})")
    sass = all(g.get("mma") is not None for g in r["gemms"] + o["gemms"] if g["kind"] != "rotation")
    mine = sorted(_gemm_cell(g, sass) for g in r["gemms"])
    yours = sorted(_gemm_cell(g, sass) for g in o["gemms"])
    if mine != yours:
      lines.append(f"{key(r)}: GEMMs {sorted(set(mine) - set(yours))} here, "
                   f"{sorted(set(yours) - set(mine))} there")
  return lines


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench gpu_compile",
                              description=__doc__.splitlines()[0])
  p.add_argument("--target", required=True, choices=TARGETS + ("device",))
  p.add_argument("--what", default=",".join(PROGRAMS),
                 type=lambda t: _choices(t, PROGRAMS), help=f"comma-separated: {', '.join(PROGRAMS)}")
  p.add_argument("--arms", type=_arms,
                 help="RECIPE:BACKEND[:ROUTE],...: these arms instead of each program's own")
  p.add_argument("--out", help="write the report (JSON) here")
  p.add_argument("--against", help="a report (JSON) to compare with, e.g. the deviceless one")
  p.add_argument("--no-sass", action="store_true", help="skip reading the compiled kernels")
  return p


def _choices(text, allowed):
  names = [n for n in text.split(",") if n]
  bad = [n for n in names if n not in allowed]
  if bad or not names:
    raise argparse.ArgumentTypeError(f"unknown program {bad[0] if bad else text!r}; "
                                     f"allowed: {', '.join(allowed)}")
  twice = [n for i, n in enumerate(names) if n in names[:i]]
  if twice:
    raise argparse.ArgumentTypeError(f"program {twice[0]!r} is named twice in {text!r}; "
                                     "each program compiles once")
  return names


def _batches(program, arms, mesh, devices, sass):
  """Callables returning Rows of `program`: one per arm (`arms`, or the program's own)."""
  if program == "kernels":
    return [lambda: kernel_rows(mesh, sass)]
  rows = {"linear": lambda arm: linear_rows(mesh, sass, (arm,)),
          "block-8b": lambda arm: block_rows(devices, sass, (arm,))}.get(
              program, lambda arm: step_rows(program, devices, sass, (arm,)))
  arms = arms or (LINEAR_ARMS if program == "linear" else STEP_ARMS)
  return [lambda arm=arm: rows(arm) for arm in arms]


def _arms(text):
  """'bf16:xla,mxfp4:native:scaled_matmul' -> ((recipe, backend, route or None), ...)."""
  routes = [r for r in backends.NATIVE_ROUTES if r != "auto"]
  arms = []
  for item in filter(None, text.split(",")):
    parts = item.split(":")
    name, backend, route = (parts + [None, None])[:3]
    if len(parts) not in (2, 3):
      why = ("want RECIPE:BACKEND or RECIPE:native:ROUTE, e.g. mxfp4:pallas or "
             "mxfp4:native:scaled_dot")
    elif name not in recipes.recipe_names():
      why = f"unknown recipe {name!r}; allowed: {', '.join(recipes.recipe_names())}"
    elif backend not in recipes.BACKENDS:
      why = f"unknown backend {backend!r}; allowed: {', '.join(recipes.BACKENDS)}"
    elif route is not None and backend != "native":
      why = f"a route ({route!r}) is for the native backend only: {name}:native:{route}"
    elif route is not None and route not in routes:
      why = (f"unknown native route {route!r}; allowed: {', '.join(routes)} (none: "
             "the route the formats take)")
    elif (name, backend, route) in arms:
      why = f"named twice in {text!r}; each arm compiles once"
    else:
      arms.append((name, backend, route))
      continue
    raise argparse.ArgumentTypeError(f"arm {item!r}: {why}")
  if not arms:
    raise argparse.ArgumentTypeError(f"no arm in {text!r}; want RECIPE:BACKEND[:ROUTE],...")
  return tuple(arms)


def _refuse_arms(arms, capability, target):
  """check_arms, as `gpu_compile: --arms ...` and exit status 2."""
  try:
    check_arms(arms, capability, target)
  except ValueError as e:
    print(f"gpu_compile: --arms: {e}", file=sys.stderr)
    sys.exit(2)


def _check_report(report):
  """Raises ValueError unless `report` has the fields of a gpu_compile report that
  --against reads."""
  if not isinstance(report, dict):
    raise ValueError(f"not a gpu_compile report (a JSON object), got {type(report).__name__}")
  missing = [k for k in ("device", "versions", "rows") if k not in report]
  if missing:
    raise ValueError(f"not a gpu_compile report: field {missing[0]!r} is missing")
  fields = ("program", "recipe", "backend", "compiled", "error", "gemms")
  for i, row in enumerate(report["rows"] if isinstance(report["rows"], list) else [None]):
    if not isinstance(row, dict) or any(k not in row for k in fields):
      raise ValueError(f"not a gpu_compile report: rows[{i}] must be an object with the "
                       f"fields {', '.join(fields)}")


def _versions():
  out = {"jax": jax.__version__}
  for name in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def git_commit():
  """The checkout's git commit ('+' when files differ from it), or None outside git."""
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           check=True, capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+" if dirty else "")


def main(argv):
  args = parser().parse_args(argv)
  if args.target != "device":  # compile only: no CUDA device, no CUDA version check
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    jax.config.update("jax_platforms", "cpu")
  if args.out and not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):
    print(f"gpu_compile: --out {args.out!r}: its folder does not exist or is not writable",
          file=sys.stderr)
    sys.exit(2)
  against = None
  if args.against:
    try:
      with open(args.against) as f:
        against = json.load(f)
      _check_report(against)
    except (OSError, ValueError) as e:
      print(f"gpu_compile: --against {args.against!r}: {e}", file=sys.stderr)
      sys.exit(2)
  arms = args.arms or ()
  if args.target != "device":  # before the CUDA plugin is needed
    _refuse_arms(arms, target_capability(args.target), args.target)
  try:
    devices = target_devices(args.target)
  except Exception as e:  # pylint: disable=broad-except
    print(f"gpu_compile: cannot get a {args.target} device to compile for: {one_line(e)} "
          "(install the CUDA plugin: pip install -e \".[gpu-compile]\")", file=sys.stderr)
    sys.exit(2)
  if args.target == "device":
    capability = backends.cuda_capability(devices[0])
    if isinstance(capability, str):
      print(f"gpu_compile: --target device: {capability}", file=sys.stderr)
      sys.exit(2)
    _refuse_arms(arms, capability, f"device ({devices[0].device_kind})")
  mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
  sass = not args.no_sass
  report = dict(target=args.target, device=devices[0].device_kind,
                date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                commit=git_commit(), versions=_versions(), options=COMPILE_OPTIONS,
                cpus=os.cpu_count(), rows=[])
  rows = []
  for program in args.what:
    for batch in _batches(program, args.arms, mesh, devices, sass):
      rows += batch()
      report["rows"] = [dataclasses.asdict(r) for r in rows]
      if args.out:  # after each arm, so that an interrupted report keeps what it has
        atomic.write_text(args.out, json.dumps(report, indent=1))
  print(f"{report['date']}, {report['device']} ({args.target}), commit {report['commit']}, "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + f", {COMPILE_OPTIONS}")
  print(markdown(rows))
  if against is not None:
    lines = differences(report, against)
    print(f"\nagainst {args.against} ({against['device']}, {against['versions']}): "
          + (f"{len(lines)} differences" if lines else "no differences"))
    print("\n".join(f"- {line}" for line in lines))
  failed = [f"{r.program} {r.recipe} {r.backend}" for r in rows if not r.compiled]
  if failed:
    print(f"gpu_compile: {len(failed)} programs did not compile: {'; '.join(failed)}",
          file=sys.stderr)
    sys.exit(1)
