"""Kernel counts of an optimized HLO module (`compiled.as_text()`).

A cheap stand-in for a profiler: every instruction outside fused computations
that is not bookkeeping (parameter, tuple, bitcast, ...) is one kernel launch
on a GPU (a fusion, a cuBLAS or Triton custom call, a copy). Computations
reached through `call` (e.g. command buffers), `while` and `conditional` are
counted once each, so a loop body's kernels count once, not per iteration.
"""

import collections
import math
import re

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*?\s([a-z][a-z0-9\-]*)\(")
_FOLLOW = {"call": ("to_apply",), "while": ("body", "condition"),
           "conditional": ("branch_computations", "true_computation",
                           "false_computation")}
_BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                "call", "while", "conditional", "after-all", "opt-barrier",
                "partition-id", "replica-id", "add-dependency"}


def _computations(hlo_text):
  """(entry name, {name: [(opcode, line)]}) of an HLO module's text."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      comps[current] = []
      if header.group(1):
        entry = current
      continue
    op = _INSTRUCTION.match(line)
    if op and current is not None:
      comps[current].append((op.group(1), line))
  return entry, comps


def _called(line, keys):
  names = []
  for key in keys:
    m = re.search(key + r"=\{?([^}\s]+(?:,\s*%?[\w.\-]+)*)\}?", line)
    if m:
      names += [n.strip().lstrip("%") for n in m.group(1).split(",")]
  return names


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def executions(hlo_text):
  """{computation: how many times it runs per run of the module}: a while loop's body
  runs XLA's known trip count (backend_config known_trip_count; 1 where unknown) per
  run of the loop; fused, called and branch computations once per call (every branch
  of a conditional: an upper bound)."""
  entry, comps = _computations(hlo_text)
  runs = collections.Counter()

  def visit(name, n):
    if name not in comps:
      return
    runs[name] += n
    for opcode, line in comps[name]:
      trips = _TRIP_COUNT.search(line) if opcode == "while" else None
      for called in _called(line, ("body",)) if opcode == "while" else ():
        visit(called, n * (int(trips.group(1)) if trips else 1))
      for called in _called(line, ("calls", "to_apply", "branch_computations",
                                   "true_computation", "false_computation")):
        visit(called, n)

  if entry:
    visit(entry, 1)
  return dict(runs)


def instruction_lines(hlo_text):
  """[(computation, line)] of every instruction of an HLO module's text."""
  return [(name, line) for name, ops in _computations(hlo_text)[1].items() for _, line in ops]


def kernel_counts(hlo_text):
  """Counter opcode -> kernels launched per call (see the module docstring).

  Empty if the text has no ENTRY computation.
  """
  entry, comps = _computations(hlo_text)
  counts, todo, seen = collections.Counter(), [entry] if entry else [], set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for opcode, line in comps[name]:
      if opcode in _FOLLOW:
        todo += _called(line, _FOLLOW[opcode])
      if opcode not in _BOOKKEEPING:
        counts[opcode] += 1
  return counts


_CUDNN_BLOCK_SCALED = ("__cudnn$blockScaledDot", "__op$block_scaled_dot")
_PLAIN_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul")
# An instruction's name, element type and dims; for a tuple-shaped one (cuBLAS's
# (result, workspace)) its first element's.
_SHAPED = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = \(?(\w+)\[([\d,]*)\]")
_DOT = re.compile(r"\s(dot|scaled-dot)\(%?([\w.\-]+)(?:, %?([\w.\-]+))?")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
# The fusion's kind wherever it sits in its backend config (a device's compile puts
# the tile configuration, block_level_fusion_config, before it).
_BACKEND_KIND = re.compile(r'fusion_backend_config":\{.*?"kind":"(\w+)"')
_HLO_KIND = re.compile(r"kind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# A Mosaic GPU custom call carries its MLIR module, whose kernel is NAME_mosaic_gpu;
# the cubin's kernel is NAME_mosaic_gpu_kernel (fp4jax's kernels are named fp4jax_*).
_MOSAIC_KERNEL = re.compile(r"(fp4jax_\w+?_mosaic_gpu)(?!\w)")


def gemms(hlo_text):
  """Every GEMM of an optimized HLO module, fused ones included, in text order.

  A list of dicts: op ("dot", "scaled-dot" or "custom-call"), target (a custom
  call's), operands (the element types of its first two operands, as the GEMM
  reads them), shape (its output's dims), k (the contraction length; a Mosaic GPU
  GEMM's, lhs [M, K] -> out [M, N], from its lhs; None for other custom calls), kernel
  (the instruction that launches it: the outermost fusion around it, or the
  custom call itself; None for a dot outside any fusion) and kernel_kind (that
  fusion's backend kind, e.g. "__triton_nested_gemm_fusion", or its HLO kind) and
  computation (the one the GEMM's instruction sits in: `executions` says how often it runs).
  """
  shapes, caller, rows = {}, {}, []
  current = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
    m = _SHAPED.match(line)
    if m:
      shapes[m.group(1)] = (m.group(2), [int(d) for d in m.group(3).split(",") if d])
      called = _CALLS.search(line)
      if called and " fusion(" in line:
        kind = _BACKEND_KIND.search(line) or _HLO_KIND.search(line)
        caller[called.group(1)] = (m.group(1), current, kind and kind.group(1))
    if not m or current is None:
      continue
    if "custom-call(" in line:
      target = _TARGET.search(line)
      target = target.group(1) if target else ""
      mosaic = _MOSAIC_KERNEL.search(line) if target.startswith("mosaic_gpu") else None
      if mosaic or target in _CUDNN_BLOCK_SCALED or target.startswith(_PLAIN_GEMM_CALLS):
        args = re.search(r"custom-call\(%?([\w.\-]+), %?([\w.\-]+)", line)
        lhs = shapes.get(args.group(1), ("?", [])) if args else ("?", [])
        shape = shapes[m.group(1)][1]
        rows.append(dict(op="custom-call", target=target, operands=[
            shapes.get(a, ("?",))[0] for a in (args.groups() if args else ())],
            shape=shape, k=math.prod(lhs[1]) // shape[0] if mosaic and lhs[1] else None,
            kernel=mosaic.group(1) + "_kernel" if mosaic else m.group(1), kernel_kind=target,
            computation=current))
      continue
    dot = _DOT.search(line)
    if not dot:
      continue
    lhs = shapes.get(dot.group(2), ("?", []))
    dims = _LHS_CONTRACTING.search(line)
    k = 1 if lhs[1] else None
    for d in (dims.group(1).split(",") if dims and dims.group(1) and k else []):
      k *= lhs[1][int(d)] if int(d) < len(lhs[1]) else 1
    rows.append(dict(op=dot.group(1), target=None, operands=[
        shapes.get(a, ("?",))[0] for a in dot.groups()[1:] if a],
        shape=shapes[m.group(1)][1], k=k, kernel=None, kernel_kind=None, computation=current))
  for row in rows:  # the outermost fusion around each fused GEMM
    comp = row["computation"]
    while comp in caller:
      row["kernel"], comp, row["kernel_kind"] = caller[comp]
  return rows


def gemm_kind(gemm, rotation_max=32):
  """One GEMM of `gemms` as a gemm_kinds kind."""
  if gemm["op"] == "custom-call":
    if gemm["target"].startswith("mosaic_gpu"):
      return "Mosaic GPU"
    if gemm["target"] in _CUDNN_BLOCK_SCALED:
      return "block-scaled (cuDNN)"
    known = [t for t in gemm["operands"] if t != "?"]
    return f"cuBLAS {known[0]}" if known else "cuBLAS"
  if gemm["op"] == "scaled-dot":
    return "block-scaled (scaled-dot)"
  if gemm["k"] is not None and gemm["k"] <= rotation_max:
    return "rotation"
  return f"dot {gemm['operands'][0]}"


def gemm_kinds(hlo_text, rotation_max=32):
  """Counter of the GEMMs an optimized HLO module runs, fused ones included, by kind:

  "block-scaled (cuDNN)": a cuDNN block-scaled dot custom call;
  "Mosaic GPU": a Pallas Mosaic GPU GEMM kernel of fp4jax (fp4jax.kernels.hopper_gemm);
  "block-scaled (scaled-dot)": an HLO scaled-dot (what Triton's dot_scaled runs);
  "cuBLAS DTYPE": a cuBLAS / cuBLASLt GEMM custom call (FP8 ones among them) reading
  DTYPE operands (its lhs's; "cuBLAS" where they are not in the text);
  "dot DTYPE": a plain dot with DTYPE operands (its lhs's) and a contraction
  longer than rotation_max; "rotation": a dot contracting rotation_max or fewer
  elements (a Hadamard block). Every instruction line counts once, wherever it sits.
  """
  return collections.Counter(gemm_kind(g, rotation_max) for g in gemms(hlo_text))


def gemm_summary(counts):
  """'kind n, kind n' of gemm_kinds' Counter, block-scaled kinds first."""
  return ", ".join(f"{k} {n}" for k, n in sorted(
      counts.items(), key=lambda kv: (not kv[0].startswith("block"), kv[0])))
