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
