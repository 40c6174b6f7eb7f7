"""The main loop of each compiled GPU kernel, read from its SASS, and the ceiling it implies.

  python -m fp4jax.bench sass_loops --target h200 [--programs mosaic,mgpu_bf16,...]
      [--shapes 4096x4096x4096,16384x4096x14336] [--out REPORT.json]

Needs jax's CUDA plugin (`pip install -e ".[gpu-compile]"`, Python >= 3.12); no
GPU. Each program (PROGRAMS) is compiled without a device for the target as
fp4jax.bench.gpu_compile compiles (its abstract device, autotuning off); the
cubin of every kernel is read from the executable (fp4jax.bench.gpu_binary) and
disassembled with nvdisasm. Per kernel that runs a tensor-core instruction:

- its main loop: from the SASS control flow, every backward branch (a branch
  whose target label is at or before it) closes a loop [label, branch]; the
  main loop is the innermost one that contains a tensor-core instruction.
  Counts are static (each instruction once: code the loop branches around, a
  wait's retry loop, counts once), per warp, per iteration;
- its instruction mix per iteration (one K step; the K it covers: the loop's
  multiply-accumulates over the warpgroup's output tile, where the program
  states that tile) and per 64 x 128 x 32 multiply-accumulates (one FP8
  wgmma's work): tensor-core instructions by kind and shape, FP32 arithmetic
  (FMUL, FFMA, FADD), shared memory accesses (LDS, LDSM, STS), local-memory
  (spill) accesses (LDL, STL), barriers and waits, and all instructions;
- the bound that mix implies on one SM (MACHINE, stated in the output):
  clocks per iteration of the tensor cores, the FP32 lanes, instruction issue
  and shared memory, whichever is largest, and the ceiling: the loop's
  multiply-accumulates per clock over the bf16 tensor peak (1.0 = bf16 peak;
  2.0 is FP8's peak). Only the loop is modelled: no global memory, no
  prologue or epilogue, no latency; a ceiling, not a prediction;
- its registers per thread at launch and its stack frame (spills and local
  arrays; both from the cubin's .nv.info), the highest register its code names
  (above the launch count where `setmaxnreg` raised it), and for Mosaic GPU
  kernels the report of the ptxas run that built them (MOSAIC_GPU_DUMP_TO with
  MOSAIC_GPU_DUMP_PTXAS: registers, spill stores and loads). XLA's own kernels
  dump no PTX here, so theirs is the cubin's stack frame.
"""

import argparse
import collections
import dataclasses
import datetime
import glob
import json
import os
import re
import sys
import tempfile

from fp4jax.bench import gpu_binary

# One Hopper SM (H100 / H200, sm_90: 132 SMs at 1.83 GHz boost give the datasheets'
# 1979 dense FP8 and 989 dense bf16 TFLOP/s: 1979e12 / (2 * 132 * 1.83e9) = 4096
# MAC per clock per SM). FP32: 128 lanes per SM; 4 sub-partitions (SMSPs), each
# issuing one warp instruction per clock; shared memory one 128-byte wavefront per clock.
MACHINE = {"h200": {"smsp": 4, "mac_per_clk": {"fp8": 4096, "int8": 4096, "bf16": 2048,
                                               "tf32": 1024},
                    "fp32_lanes": 128, "issue_per_smsp": 1, "smem_bytes_per_clk": 128}}
FP32_OPS = ("FMUL", "FFMA", "FADD")
_BARRIER = re.compile(r"^(BAR|SYNCS|WARPGROUP|DEPBAR|MEMBAR|WARPSYNC|ARRIVES|ELECT|BSYNC|"
                      r"BSSY|NANOSLEEP)\b")
_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w]+)*)\s*"
                   r"([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+|\.L_\w+):")
_SECTION = re.compile(r"^\s*\.section\s+\.text\.([\w.$]+),")
_BRANCH_TARGET = re.compile(r"`\((\.L_\w+)\)")
_GMMA_SHAPE = re.compile(r"^([A-Z])GMMA\.(\d+)x(\d+)x(\d+)")
_HMMA_SHAPE = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "16832": (16, 8, 32)}


@dataclasses.dataclass(frozen=True)
class Instruction:
  address: int
  opcode: str  # with its modifiers: QGMMA.64x128x32.F32.E4M3.E4M3
  operands: str

  @property
  def base(self):
    return self.opcode.split(".")[0]


def parse(sass):
  """{kernel: ([Instruction], {label: address})} of nvdisasm's text."""
  kernels, current, pending = {}, None, []
  for line in sass.splitlines():
    section = _SECTION.match(line)
    if section:
      current = section.group(1)
      kernels[current] = ([], {})
      continue
    if current is None:
      continue
    label = _LABEL.match(line.strip())
    if label:
      pending.append(label.group(1))
      continue
    found = _LINE.match(line)
    if found:
      address = int(found.group(1), 16)
      instructions, labels = kernels[current]
      labels.update((name, address) for name in pending)
      pending = []
      instructions.append(Instruction(address, found.group(3), found.group(4).strip()))
  return kernels


def is_tensor(instruction):
  return bool(gpu_binary.MMA.match(f"{instruction.opcode} {instruction.operands}"))


def loops(instructions, labels):
  """[(start, end)] addresses of every loop: a branch back to a label at or before it."""
  found = []
  for i in instructions:
    target = _BRANCH_TARGET.search(i.operands)
    if i.base in ("BRA", "JMP") and target and labels.get(target.group(1), 1 << 62) <= i.address:
      found.append((labels[target.group(1)], i.address))
  return found


def main_loop(instructions, labels):
  """The instructions of the innermost loop holding a tensor-core instruction, or None."""
  tensor = [i.address for i in instructions if is_tensor(i)]
  holding = [(end - start, start, end) for start, end in loops(instructions, labels)
             if any(start <= a <= end for a in tensor)]
  if not holding:
    return None
  _, start, end = min(holding)
  return [i for i in instructions if start <= i.address <= end]


def mma_shape(opcode):
  """(m, n, k, element kind, per warp): a warpgroup MMA (wgmma: GMMA) is one
  instruction in each of its 4 warps; a warp MMA (HMMA, IMMA) is its warp's own."""
  fields = opcode.split(".")
  gmma = _GMMA_SHAPE.match(opcode)
  if gmma:
    m, n, k = map(int, gmma.groups()[1:])
    per_warp = 4
  elif fields[1] in _HMMA_SHAPE:
    (m, n, k), per_warp = _HMMA_SHAPE[fields[1]], 1
  else:
    raise ValueError(f"unknown tensor-core instruction shape {opcode!r}")
  types = set(fields[2:])
  if types & {"E4M3", "E5M2"}:
    kind = "fp8"
  elif types & {"S8", "U8"} or fields[0].startswith("I"):
    kind = "int8"
  elif "TF32" in types:
    kind = "tf32"
  else:
    kind = "bf16"  # F16 and BF16: the same rate
  return m, n, k, kind, per_warp


def _wavefronts(instruction):
  """Shared-memory wavefronts (128 bytes each) of one warp's instruction, at least:
  an LDS / STS one (exact for a 32-bit access without bank conflicts and for a
  broadcast, as the scale loads of the GEMMs here are; more for a wide access to 32
  distinct addresses), an LDSM one per 8 x 8 16-bit matrix, a wgmma its
  shared-memory operands' bytes (A and B from a descriptor, or B alone) over 128,
  its warp's quarter."""
  fields = instruction.opcode.split(".")
  if instruction.base in ("LDS", "STS"):
    return 1
  if instruction.base in ("LDSM", "STSM"):  # .M88.4: four matrices
    return int(next((f for f in fields[2:] if f.isdigit()), "1"))
  gmma = _GMMA_SHAPE.match(instruction.opcode)
  if gmma:
    m, n, k = map(int, gmma.groups()[1:])
    size = 1 if mma_shape(instruction.opcode)[3] in ("fp8", "int8") else 2
    a_in_smem = instruction.operands.split(",")[1].strip().startswith("gdesc")
    return ((m * k if a_in_smem else 0) + n * k) * size / 128 / 4
  return 0


def mix(loop):
  """The instruction mix of a loop's instructions (one warp, one iteration)."""
  tensor = collections.Counter(i.opcode for i in loop if is_tensor(i))
  bases = collections.Counter(i.base for i in loop)
  shapes = [mma_shape(op) + (c,) for op, c in tensor.items()]
  return {
      "instructions": sum(c for b, c in bases.items() if b != "NOP"),
      "tensor": dict(tensor),
      "fp32": {op: bases[op] for op in FP32_OPS},
      "shared": {op: bases[op] for op in ("LDS", "LDSM", "STS") if bases[op]},
      "spill": {op: bases[op] for op in ("LDL", "STL")},
      "barriers": sum(c for b, c in bases.items() if _BARRIER.match(b)),
      "warpgroup_macs": sum(m * n * k * c * 4 // per_warp for m, n, k, _, per_warp, c in shapes),
      "smem_wavefronts": sum(_wavefronts(i) for i in loop),
      "macs_per_warp": sum(m * n * k * c // per_warp for m, n, k, _, per_warp, c in shapes),
      "clk_tensor": sum(m * n * k * c / per_warp / model_rate(kind)
                        for m, n, k, kind, per_warp, c in shapes),
  }


def model_rate(kind, target="h200"):
  """Multiply-accumulates per clock of one SMSP (a quarter of the SM)."""
  machine = MACHINE[target]
  return machine["mac_per_clk"][kind] / machine["smsp"]


def bound(loop_mix, target="h200"):
  """Clocks per iteration on one SMSP of each resource (one warp of the loop on each
  SMSP; more warps share them alike), the largest, and the ceiling: the loop's
  multiply-accumulates per clock over the bf16 tensor peak."""
  machine = MACHINE[target]
  per_smsp = lambda per_sm: per_sm / machine["smsp"]
  clocks = {"tensor": loop_mix["clk_tensor"],
            "fp32": sum(loop_mix["fp32"].values()) * 32 / per_smsp(machine["fp32_lanes"]),
            "issue": loop_mix["instructions"] / machine["issue_per_smsp"],
            "shared": loop_mix["smem_wavefronts"] * machine["smsp"]}
  limit = max(clocks, key=clocks.get)
  ceiling = loop_mix["macs_per_warp"] / clocks[limit] / model_rate("bf16", target)
  return clocks, limit, ceiling


def machine_line(target="h200"):
  m = MACHINE[target]
  rates = ", ".join(f"{k} {v}" for k, v in m["mac_per_clk"].items())
  return (f"machine model ({target}, per SM per clock): tensor MAC {rates}; FP32 "
          f"{m['fp32_lanes']} lanes; {m['smsp']} SMSPs issuing {m['issue_per_smsp']} warp "
          f"instruction per clock each; shared memory one {m['smem_bytes_per_clk']}-byte "
          "wavefront, at least (an LDS/STS one: broadcast or conflict-free 32-bit; an LDSM "
          "one per 8x8 matrix; a wgmma its shared operands' bytes / 128)")


# program -> builder(m, k, n) -> (function, [(shape, dtype) of its arguments], the output
# tile (m, n) of one warpgroup, or None where the compiler picks it).
def _mosaic_exact(m, k, n):
  """fp4jax.kernels.hopper_gemm as the `mosaic` backend calls it: E2M1 held as E4M3,
  float32 block scales, one promotion per 32-block."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fp4jax.kernels import hopper_gemm  # pylint: disable=g-import-not-at-top
  args = [((m, k), jnp.float8_e4m3fn), ((n, k), jnp.float8_e4m3fn),
          ((k // hopper_gemm.BLOCK, m), jnp.float32), ((k // hopper_gemm.BLOCK, n), jnp.float32)]
  return (lambda a, b, sa, sb: hopper_gemm.matmul(a, b, sa, sb, interpret=False)), args, \
      hopper_gemm.TILE[hopper_gemm.BLOCK]


def _mosaic_fast(m, k, n):
  """The `mosaic_fast` backend's GEMM: E4M3 elements with each 32-block's scale folded
  in, float32 scales per 128-element chunk, one promotion per chunk."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fp4jax.kernels import hopper_gemm  # pylint: disable=g-import-not-at-top
  chunk = hopper_gemm.CHUNK
  args = [((m, k), jnp.float8_e4m3fn), ((n, k), jnp.float8_e4m3fn),
          ((k // chunk, m), jnp.float32), ((k // chunk, n), jnp.float32)]
  return (lambda a, b, sa, sb: hopper_gemm.matmul(a, b, sa, sb, interpret=False,
                                                  block=chunk)), args, hopper_gemm.TILE[chunk]


def _mosaic_fast_fp8(m, k, n):
  """`mosaic_fast` on per-tensor FP8 (the fp8 recipe): no scales, one float32 addition
  per 128-element chunk (E4M3 x E5M2, as its Dgrad)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fp4jax.kernels import hopper_gemm  # pylint: disable=g-import-not-at-top
  args = [((m, k), jnp.float8_e4m3fn), ((n, k), jnp.float8_e5m2)]
  return (lambda a, b: hopper_gemm.matmul(a, b, interpret=False, block=hopper_gemm.CHUNK)), \
      args, hopper_gemm.TILE[hopper_gemm.CHUNK]


def _xla_bf16(m, k, n):
  """XLA's own bf16 GEMM (what the bf16 recipe's layers run): [M, K] x [N, K]^T -> bf16."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  dims = (((1,), (1,)), ((), ()))
  return (lambda a, b: lax.dot_general(a, b, dims)), [((m, k), jnp.bfloat16),
                                                       ((n, k), jnp.bfloat16)], None


def _mgpu_bf16(m, k, n):
  """jax's Pallas Mosaic GPU Hopper matmul (jax.experimental.pallas.ops.gpu.
  hopper_matmul_mgpu) at bf16, 128 x 128 x 64 tiles, 4 stages: the reference
  Hopper kernel of the same compiler."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as mgpu  # pylint: disable=g-import-not-at-top
  config = mgpu.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
  return (lambda a, b: mgpu.matmul(a, b, None, config)), [((m, k), jnp.bfloat16),
                                                          ((k, n), jnp.bfloat16)], (128, 128)


PROGRAMS = {"mosaic": _mosaic_exact, "mosaic_fast": _mosaic_fast,
            "mosaic_fast_fp8": _mosaic_fast_fp8, "xla_bf16": _xla_bf16, "mgpu_bf16": _mgpu_bf16}
SHAPES = ((4096, 4096, 4096), (16384, 4096, 14336))  # M x K x N


@dataclasses.dataclass
class Kernel:
  """One kernel of a compiled program: its main loop's mix and bound (JSON-ready)."""
  program: str
  shape: tuple  # (M, K, N)
  kernel: str
  registers: int | None = None  # at launch (the cubin's)
  registers_used: int | None = None  # highest register named + 1 (setmaxnreg may raise it)
  stack_bytes: int | None = None  # the cubin's stack frame: spills and local arrays
  ptxas: str | None = None  # ptxas's own lines for this kernel, where found
  loop: dict | None = None  # mix()
  k_per_iteration: int | None = None  # over the warpgroup's output tile, where known
  per_wgmma: dict | None = None  # instructions and FP32 ops per 64x128x32 of MACs
  clocks: dict | None = None  # bound()
  limit: str | None = None
  ceiling: float | None = None


def analyse(program, shape, image, ptxas_lines=None, tile=None, target="h200"):
  """The Kernel of one cubin (None for one without a tensor-core main loop)."""
  name = gpu_binary.kernel_name(image)
  if name is None:  # not a GPU kernel (Mosaic GPU's host object)
    return None
  instructions, labels = parse(gpu_binary.disassemble(image)).get(name, ([], {}))
  loop = main_loop(instructions, labels)
  if loop is None:
    return None
  res = gpu_binary.resources(image).get(name, {})
  row = Kernel(program, tuple(shape), name, res.get("registers"), res.get("stack_bytes"),
               ptxas=(ptxas_lines or {}).get(name))
  row.registers_used = 1 + max((int(r) for i in instructions
                                for r in re.findall(r"\bR(\d+)\b", i.operands)), default=-1)
  row.loop = mix(loop)
  if tile is not None:
    row.k_per_iteration = row.loop["warpgroup_macs"] // (tile[0] * tile[1])
  wgmmas = row.loop["warpgroup_macs"] / (64 * 128 * 32)
  row.per_wgmma = {"instructions": round(row.loop["instructions"] / wgmmas, 1),
                   "fp32": round(sum(row.loop["fp32"].values()) / wgmmas, 1)}
  row.clocks, row.limit, row.ceiling = bound(row.loop, target)
  return row


_PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")


def ptxas_report(text):
  """{kernel: 'Used R registers, ... bytes spill stores, ... spill loads'} of ptxas -v output."""
  out, current = {}, None
  for line in text.splitlines():
    found = _PTXAS_FUNCTION.search(line)
    if found:
      current = found.group(1)
    elif current and ("spill" in line or "Used" in line):
      out[current] = (out.get(current, "") + " " + line.split(":", 1)[-1].strip()).strip()
  return out


def compile_program(program, shape, mesh):
  """Kernels of `program` at `shape` (M, K, N) compiled for the mesh's device."""
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax import sharding  # pylint: disable=g-import-not-at-top
  from fp4jax.bench import gpu_compile  # pylint: disable=g-import-not-at-top
  fn, args, tile = PROGRAMS[program](*shape)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in args]
  with tempfile.TemporaryDirectory() as dump:
    os.environ.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1")
    try:
      with sharding.use_mesh(mesh):
        compiled = jax.jit(fn, out_shardings=replicated).lower(*args).compile(
            gpu_compile.COMPILE_OPTIONS)
    finally:
      for var in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS"):
        os.environ.pop(var, None)
    report = {}
    for path in glob.glob(os.path.join(dump, "**", "*ptxas*"), recursive=True):
      with open(path) as f:
        report.update(ptxas_report(f.read()))
  rows = [analyse(program, shape, image, report, tile) for image in gpu_binary.cubins(compiled)]
  return [r for r in rows if r is not None]


def _counts(counter):
  return " ".join(f"{k} {v}" for k, v in sorted(counter.items()) if v) or "0"


def markdown(rows):
  """The report's table: one line per kernel (counts per warp, per loop iteration)."""
  out = ["| program | M x K x N | kernel | registers (used) | spills (ptxas) | K / iter | "
         "instructions | tensor | FP32 | shared | LDL+STL | barriers | per 64x128x32: "
         "instructions, FP32 | clocks: tensor, FP32, issue, shared | bound | ceiling x bf16 |",
         "|" + "---|" * 16]
  for r in rows:
    loop, c = r.loop, r.clocks
    spills = re.search(r"(\d+) bytes spill stores", r.ptxas or "")
    spills = (f"{spills.group(1)} B" if spills else
              f"stack {r.stack_bytes} B" if r.stack_bytes is not None else "-")
    out.append(
        f"| {r.program} | {'x'.join(map(str, r.shape))} | {r.kernel} | {r.registers} "
        f"({r.registers_used}) | {spills} | "
        f"{r.k_per_iteration or '-'} | {loop['instructions']} | {_counts(loop['tensor'])} | "
        f"{_counts(loop['fp32'])} | {_counts(loop['shared'])} | "
        f"{sum(loop['spill'].values())} | {loop['barriers']} | "
        f"{r.per_wgmma['instructions']}, {r.per_wgmma['fp32']} | "
        f"{c['tensor']:.0f}, {c['fp32']:.0f}, {c['issue']:.0f}, {c['shared']:.0f} | "
        f"{r.limit} | {r.ceiling:.2f} |")
  return "\n".join(out)


def _shapes(text):
  try:
    shapes = [tuple(int(d) for d in s.split("x")) for s in text.split(",") if s]
  except ValueError:
    shapes = []
  if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
    raise argparse.ArgumentTypeError(f"bad shapes {text!r}; want MxKxN[,MxKxN...], e.g. "
                                     "4096x4096x4096")
  return shapes


def parser():
  from fp4jax.bench import choice_list  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench sass_loops",
                              description=__doc__.splitlines()[0])
  p.add_argument("--target", required=True, choices=tuple(MACHINE))
  p.add_argument("--programs", default=",".join(PROGRAMS),
                 type=choice_list(tuple(PROGRAMS), "program"),
                 help=f"comma-separated: {', '.join(PROGRAMS)}")
  p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                 type=_shapes, help="GEMM shapes MxKxN, comma-separated")
  p.add_argument("--out", help="write the report (JSON) here")
  return p


def main(argv):
  args = parser().parse_args(argv)
  from fp4jax.bench import gpu_compile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    devices = gpu_compile.target_devices(args.target)
  except Exception as e:  # pylint: disable=broad-except  (no CUDA plugin)
    print(f"sass_loops: --target {args.target} needs jax's CUDA plugin "
          f"(pip install -e \".[gpu-compile]\"): {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
  mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("d",))
  rows = []
  for program in args.programs:
    for shape in args.shapes:
      rows += compile_program(program, shape, mesh)
      print(f"sass_loops: {program} {'x'.join(map(str, shape))}: compiled", file=sys.stderr,
            flush=True)
  print(machine_line(args.target))
  print(f"jax {jax.__version__}, {datetime.date.today()}; per warp, per iteration of the "
        "main loop (static counts); spills: ptxas's report for Mosaic GPU kernels, else "
        "the cubin's stack frame")
  print(markdown(rows))
  if args.out:
    from fp4jax.train import atomic  # pylint: disable=g-import-not-at-top
    atomic.write_text(args.out, json.dumps(
        {"date": str(datetime.date.today()), "jax": jax.__version__, "target": args.target,
         "machine": MACHINE[args.target], "kernels": [dataclasses.asdict(r) for r in rows]},
        indent=1))
