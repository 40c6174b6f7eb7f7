"""Kernel counts of an optimized HLO module (`compiled.as_text()`).

A cheap stand-in for a profiler: every instruction outside fused computations
that is not bookkeeping (parameter, tuple, bitcast, ...) is one kernel launch
on a GPU (a fusion, a cuBLAS or Triton custom call, a copy). Computations
reached through `call` (e.g. command buffers), `while` and `conditional` are
counted once each, so a loop body's kernels count once, not per iteration.
"""

import collections
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
_SHAPED = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"\s(dot|scaled-dot)\(%?([\w.\-]+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def gemm_kinds(hlo_text, rotation_max=32):
  """Counter of the GEMMs an optimized HLO module runs, fused ones included, by kind:

  "block-scaled (cuDNN)": a cuDNN block-scaled dot custom call;
  "block-scaled (scaled-dot)": an HLO scaled-dot (what Triton's dot_scaled runs);
  "cuBLAS": a cuBLAS / cuBLASLt GEMM custom call (FP8 ones among them);
  "dot DTYPE": a plain dot with DTYPE operands (its lhs's) and a contraction
  longer than rotation_max; "rotation": a dot contracting rotation_max or fewer
  elements (a Hadamard block). Every instruction line counts once, wherever it sits.
  """
  shapes = {}
  for line in hlo_text.splitlines():
    m = _SHAPED.match(line)
    if m:
      shapes[m.group(1)] = (m.group(2), [int(d) for d in m.group(3).split(",") if d])
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    if "custom-call(" in line:
      if any(f'"{t}"' in line for t in _CUDNN_BLOCK_SCALED):
        counts["block-scaled (cuDNN)"] += 1
      elif any(f'"{t}' in line for t in _PLAIN_GEMM_CALLS):
        counts["cuBLAS"] += 1
      continue
    dot = _DOT.search(line)
    if not dot:
      continue
    if dot.group(1) == "scaled-dot":
      counts["block-scaled (scaled-dot)"] += 1
      continue
    dtype, shape = shapes.get(dot.group(2), ("?", []))
    dims = _LHS_CONTRACTING.search(line)
    k = 1
    for d in (dims.group(1).split(",") if dims and dims.group(1) else []):
      k *= shape[int(d)] if int(d) < len(shape) else 1
    counts["rotation" if shape and k <= rotation_max else f"dot {dtype}"] += 1
  return counts


def gemm_summary(counts):
  """'kind n, kind n' of gemm_kinds' Counter, block-scaled kinds first."""
  return ", ".join(f"{k} {n}" for k, n in sorted(
      counts.items(), key=lambda kv: (not kv[0].startswith("block"), kv[0])))
