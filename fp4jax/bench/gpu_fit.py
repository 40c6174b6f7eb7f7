"""Will a training config fit N GPUs? Its train step compiled for them, without a GPU.

  python -m fp4jax.bench gpu_fit --target h100|h200|b200 [--devices 8] [--hosts 1]
      --config CONFIG.py [--config.KEY=VALUE ...] [--out REPORT.json]

Compiles the trainer's own jitted train step (fp4jax.train.step.make_programs: the
config's model, recipe, optimizer, micro-batches and mesh) for `--devices`
compile-only GPUs of the target on `--hosts` hosts (fp4jax.bench.gpu_compile's
device descriptions through jax.experimental.topologies; XLA's GPU compiler with
Triton and Mosaic GPU, autotuning off) and prints what one device runs (each runs
the same partitioned program):
  memory       arguments (its shards of the parameters, the optimizer state and the
               batch), outputs, temporaries, less what the outputs reuse of the
               donated state, against the device's memory: fits, or by how much not
  FLOPs        of the step's GEMMs (2 M N K each, a loop body's once per iteration:
               hlo_stats.executions), beside the model's 6N + attention FLOPs
               (fp4jax.train.throughput; full remat adds one more forward)
  collectives  per kind, how many run per step and the bytes they write
  kernels      every Triton and Mosaic GPU kernel (its operand and output types, how
               many calls of each in the program), flagging any that reads or writes
               the whole micro-batch (micro_batch x seq_len tokens) although the mesh
               splits the batch
and a one-line verdict (with the XLA_PYTHON_CLIENT_MEM_FRACTION a step needs that
fits the GPU but not the 75% of it jax's allocator takes by default). The config is
read as train.py reads it (--config.KEY=VALUE overrides, --config.quant=NAME);
--config.mesh.* must multiply to --devices, and the trainer's start-up checks run
before anything compiles (a quantization block that would straddle devices, a
micro-batch the batch shards do not divide): bad input is one line on stderr, exit
status 2. Exit status 1 when the step does not compile, does
not fit, or a kernel sees the whole micro-batch. No data is read; the vocabulary is
the tokenizer's where its file exists, else the model preset's. Only the config's
first recipe is compiled (not a quant_schedule's later ones, nor adaptive_wgrad's
switched Wgrads). Needs jax's CUDA plugin (the gpu-compile extra, Python >= 3.12).
"""

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time
import types

from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from fp4jax import errors, recipes, sharding
from fp4jax.bench import gpu_compile, gpu_shards, hlo_stats, positive_int
from fp4jax.data import tokenizers
from fp4jax.llama import block_check
from fp4jax.llama import model as model_lib
from fp4jax.train import atomic, cli, throughput
from fp4jax.train import config as train_config
from fp4jax.train import step as train_step

PROG = "gpu_fit"
GIB = 2**30
JAX_MEM_FRACTION = 0.75  # of a GPU's memory jax's allocator takes unless told otherwise


@dataclasses.dataclass
class Setup:
  """What the step compiles: the resolved config, model, recipe and mesh sizes."""
  config: object
  model_cfg: object
  recipe: object
  mesh_sizes: tuple
  vocabulary: str  # where the vocabulary size came from


def parser():
  p = argparse.ArgumentParser(
      prog="python -m fp4jax.bench gpu_fit", description=__doc__.splitlines()[0],
      allow_abbrev=False,
      epilog="--config.KEY=VALUE (or --config.quant=NAME) overrides a key of the config "
             "file, as train.py's do; --config.mesh.data / fsdp / tensor set the mesh.")
  p.add_argument("--target", required=True, choices=gpu_compile.TARGETS)
  p.add_argument("--devices", type=positive_int, default=8, help="GPUs in all (default 8)")
  p.add_argument("--hosts", type=positive_int, default=1,
                 help="hosts the GPUs are on, as many on each (default 1)")
  p.add_argument("--config", required=True, help="a config file (.py with get_config())")
  p.add_argument("--out", help="write the report (JSON) here")
  return p


def load_config(path, overrides):
  """The config file's ConfigDict with `overrides` (["--config.KEY=VALUE", ...])
  applied as train.py applies them; errors.UserError (one line) when it cannot."""
  argv = cli.expand_quant_flag([PROG, f"--config={path}"] + list(overrides))
  cli.check_config_overrides(argv)
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", path, flag_values=values, sys_argv=argv)
  try:
    values(argv)
  except flags.Error as e:
    raise errors.UserError(str(e).splitlines()[0]) from None
  return values.config


def start_up(config, n_devices, capability, target):
  """The Setup of `config` on `n_devices` GPUs of compute capability `capability`
  ((major, minor) of `target`), after the trainer's start-up checks (ValueError, one
  line, for what fails them)."""
  train_config.check(config)
  recipe = recipes.from_config(config.quant, config.dtype)  # checked against the GPU first
  native = recipe.backend == "native" and recipe.native_route != "auto"
  route = recipe.native_route if native else None
  gpu_compile.check_arms(((config.quant.name, recipe.backend, route),), capability, target)
  tokenizer, vocabulary = _vocabulary(config)
  model_cfg, recipe = train_config.resolve(config, tokenizer)
  if config.model.scan_layers is None:  # as the trainer on a GPU would
    model_cfg = dataclasses.replace(model_cfg, scan_layers=train_config.scan_by_default(
        config, model_cfg, platform="gpu"))
  sizes = sharding.mesh_shape(config.mesh, n_devices)
  mesh = jax.sharding.AbstractMesh(sizes, sharding.MESH_AXES)
  micro_batch = train_step.micro_batch(config)
  if micro_batch % sharding.batch_shards(mesh):
    raise ValueError(f"micro_batch {micro_batch} (config.micro_batch; 0 = batch_size) is not "
                     f"divisible by the {sharding.batch_shards(mesh)} batch shards (data x "
                     f"fsdp) of mesh {dict(mesh.shape)}")
  block_check.check_blocks(model_cfg, recipe, mesh, micro_batch=micro_batch,
                           seq_len=config.seq_len)
  return Setup(config, model_cfg, recipe, sizes, vocabulary)


def _vocabulary(config):
  """(an object with the vocab_size resolve needs, where that size comes from)."""
  if config.model.vocab_size is not None:
    return types.SimpleNamespace(vocab_size=config.model.vocab_size), "config.model.vocab_size"
  try:
    return tokenizers.make_tokenizer(config.data.tokenizer), "the tokenizer's"
  except FileNotFoundError:
    size = model_lib.MODEL_PRESETS[config.model.name]["vocab_size"]
    return (types.SimpleNamespace(vocab_size=size),
            f"the {config.model.name} preset's (tokenizer file not found)")


def compile_step(setup, devices):
  """The compiled train step of `setup` on `devices` (a jax Compiled) and its abstract state."""
  mesh = sharding.make_mesh(setup.config.mesh, devices)
  programs = train_step.make_programs(setup.config, setup.model_cfg, setup.recipe, mesh)
  tokens = jax.ShapeDtypeStruct((setup.config.batch_size, setup.config.seq_len + 1), jnp.int32,
                                sharding=sharding.batch_sharding(mesh))
  with sharding.use_mesh(mesh):
    lowered = programs.step.lower(programs.abstract, tokens)
    return lowered.compile(gpu_compile.COMPILE_OPTIONS), programs.abstract


def measure(setup, compiled, abstract, device_memory):
  """The report's figures of one compiled step (a JSON-ready dict)."""
  config, n = setup.config, math.prod(setup.mesh_sizes)
  stats = compiled.memory_analysis()
  memory = dict(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                temporaries=stats.temp_size_in_bytes, aliased=stats.alias_size_in_bytes)
  memory["total"] = (memory["arguments"] + memory["outputs"] + memory["temporaries"]
                     - memory["aliased"])
  text = compiled.as_text()
  runs = hlo_stats.executions(text)
  gemm_flops = sum(2 * math.prod(g["shape"]) * g["k"] * runs.get(g["computation"], 1)
                   for g in hlo_stats.gemms(text) if g["k"] is not None)
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
  tokens = config.batch_size * config.seq_len
  model_flops = throughput.flops_per_token(n_params, setup.model_cfg, config.seq_len) * tokens / n
  micro_batch = train_step.micro_batch(config)
  split = sharding.batch_shards(jax.sharding.AbstractMesh(setup.mesh_sizes, sharding.MESH_AXES))
  kernels = collections.Counter(
      (kind, tuple(operands), out) for kind, out, operands in gpu_shards.kernel_calls(text))
  whole = micro_batch * config.seq_len
  rows = [dict(kind=kind, operands=list(operands), output=out, calls=count,
               whole_batch=split > 1 and _holds_batch(" ".join(operands + (out,)), micro_batch,
                                                      config.seq_len))
          for (kind, operands, out), count in sorted(kernels.items())]
  return dict(memory=memory, device_memory=device_memory,
              fits=memory["total"] <= device_memory, gemm_flops=gemm_flops,
              model_flops=model_flops, n_params=n_params,
              collectives={k: dict(count=c, bytes=b) for k, (c, b)
                           in sorted(gpu_shards.collectives(text, per_run=True).items())},
              micro_batch_tokens=whole, tokens_per_device=whole // split, kernels=rows)


def _holds_batch(type_text, micro_batch, seq_len):
  """Whether an HLO type text has an array holding the whole micro-batch: a dim of
  micro_batch x seq_len tokens, or dims [micro_batch, seq_len]."""
  for dims in gpu_shards.shapes(type_text):
    if micro_batch * seq_len in dims or any(
        dims[i:i + 2] == [micro_batch, seq_len] for i in range(len(dims) - 1)):
      return True
  return False


def verdict(report):
  """The one line: fits or not (by how much), and kernels on the whole micro-batch."""
  m, device = report["memory"]["total"], report["device_memory"]
  gpus = f"{report['devices']} x {report['device']}"
  if m <= device:
    line = f"FITS {gpus}: {_size(m)} per device of {_size(device)} ({_size(device - m)} spare)"
    if m > JAX_MEM_FRACTION * device:
      line += (f", more than jax's default {JAX_MEM_FRACTION:.0%} of it: run with "
               f"XLA_PYTHON_CLIENT_MEM_FRACTION={math.ceil(100 * m / device + 1) / 100:.2f}")
  else:
    line = (f"DOES NOT FIT {gpus}: {_size(m)} per device, {_size(m - device)} over the "
            f"{_size(device)} each has")
  whole = sum(k["calls"] for k in report["kernels"] if k["whole_batch"])
  if whole:
    line += (f"; {whole} kernel calls read or write the whole micro-batch "
             f"({report['micro_batch_tokens']:,} tokens) on every device")
  return (f"{report['config']} ({report['recipe']} on {report['backend']}, mesh "
          f"{report['mesh']}, micro_batch {report['micro_batch']}): {line}")


def print_report(report):
  mem, gib = report["memory"], _size
  print(f"{report['config']}: {report['model']} ({report['n_params']:,} parameters), "
        f"{report['recipe']} on {report['backend']}; {report['devices']} x {report['device']} "
        f"({report['target']}, {report['hosts']} host{'s' * (report['hosts'] > 1)}), mesh "
        f"{report['mesh']} (data x fsdp x tensor); batch {report['batch_size']} x "
        f"{report['seq_len']}, micro_batch {report['micro_batch']} "
        f"({report['tokens_per_device']:,} tokens per device per micro-batch); vocabulary "
        f"{report['vocabulary']}")
  print(f"compiled in {report['seconds']:.0f} s ({report['date']}, jax {report['jax']}, "
        f"commit {report['commit']})")
  print(f"memory per device: arguments {gib(mem['arguments'])}, outputs {gib(mem['outputs'])}, "
        f"temporaries {gib(mem['temporaries'])}, aliased {gib(mem['aliased'])}: total "
        f"{gib(mem['total'])} of {gib(report['device_memory'])}")
  print(f"FLOPs per device per step: GEMMs {report['gemm_flops']:.3e} (compiled), model "
        f"{report['model_flops']:.3e} (6N + attention)")
  coll = report["collectives"]
  print("collectives per device per step: " + (", ".join(
      f"{k} {v['count']:,} ({_size(v['bytes'])})" for k, v in coll.items()) or "none"))
  calls = collections.Counter()
  for k in report["kernels"]:
    calls[k["kind"]] += k["calls"]
  print(f"kernels: {calls['triton']} Triton, {calls['mosaic']} Mosaic GPU calls in the program")
  for k in report["kernels"]:
    flag = "  WHOLE MICRO-BATCH" if k["whole_batch"] else ""
    print(f"  {k['calls']:4d} x {k['kind']}: {', '.join(_compact(t) for t in k['operands'])} "
          f"-> {_compact(k['output'])}{flag}")
  print(verdict(report))


def _size(nbytes):
  """'12.34 GiB', or '5.6 MiB' under a GiB."""
  return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _compact(type_text):
  """An HLO type without its layouts: 'bf16[16384,4096]{1,0}' -> 'bf16[16384,4096]'."""
  return re.sub(r"\{[^{}]*\}", "", type_text)


def _refuse(message):
  print(f"{PROG}: {message}", file=sys.stderr)
  sys.exit(2)


def main(argv):
  p = parser()
  args, overrides = p.parse_known_args(list(argv))
  stray = [a for a in overrides if not (a.startswith("--config.") and "=" in a)]
  if stray:
    p.error(f"unrecognized arguments: {' '.join(stray)} (a config override is "
            "--config.KEY=VALUE)")
  if args.devices % args.hosts:
    _refuse(f"--devices {args.devices} is not divisible by --hosts {args.hosts}: every host "
            "holds as many GPUs")
  if args.out and not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):
    _refuse(f"--out {args.out!r}: its folder does not exist or is not writable")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # compile only: no device
  jax.config.update("jax_platforms", "cpu")
  try:
    config = load_config(args.config, overrides)
    setup = start_up(config, args.devices, gpu_compile.target_capability(args.target),
                     args.target)
  except (errors.UserError, ValueError) as e:
    _refuse(e)
  try:
    devices = gpu_compile.abstract_devices(args.target, args.devices, args.hosts)
  except Exception as e:  # pylint: disable=broad-except
    _refuse(f"cannot get {args.target} devices to compile for: {gpu_compile.one_line(e)} "
            "(install the CUDA plugin: pip install -e \".[gpu-compile]\")")
  device_memory = int(re.search(r"device_memory_size:\s*(\d+)",
                                gpu_compile.target_description(args.target)).group(1))
  start = time.perf_counter()
  try:
    compiled, abstract = compile_step(setup, devices)
  except Exception as e:  # pylint: disable=broad-except  (one line: what the compiler said)
    print(f"{PROG}: {args.config} does not compile for {args.devices} x {args.target}: "
          f"{gpu_compile.one_line(e)}", file=sys.stderr)
    sys.exit(1)
  report = dict(
      config=args.config, overrides=overrides, target=args.target,
      device=devices[0].device_kind, devices=args.devices, hosts=args.hosts,
      mesh="x".join(map(str, setup.mesh_sizes)),
      model=config.model.name, recipe=config.quant.name, backend=setup.recipe.backend,
      batch_size=config.batch_size, seq_len=config.seq_len,
      micro_batch=train_step.micro_batch(config), vocabulary=setup.vocabulary,
      seconds=time.perf_counter() - start, jax=jax.__version__,
      date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
      commit=gpu_compile.git_commit())
  report.update(measure(setup, compiled, abstract, device_memory))
  report["verdict"] = verdict(report)
  print_report(report)
  if args.out:
    atomic.write_text(args.out, json.dumps(report, indent=1))
  if not report["fits"] or any(k["whole_batch"] for k in report["kernels"]):
    sys.exit(1)
