"""What each GEMM of a train step should run in, what it ran in, and the report.

`audit(gemms, model_cfg, recipe, switch_wgrad_to=None)` names every traced
GEMM (fp4jax.audit.trace) by layer and role, sets beside it what the recipe
asks of that layer and role (the run's recipe, or "bf16" for the blocks and
head LlamaConfig.bf16_layers pins, unquantized for the GEMMs the model keeps
in its compute dtype: attention's QK^T and PV unless quantize_attention, the
head unless quantize_head) and returns `Row`s; `table(rows)` and
`summary(rows)` print them.

Roles: a GEMM of the forward is Fprop (remat's recomputation of it too); a
GEMM of the backward is the Dgrad of the forward GEMM of the same module one
of whose operands is built from the same data as that GEMM's rhs (W, for a
linear layer), and its Wgrad when built from the same data as its lhs (X).
"""

import collections
import dataclasses
import re

import jax.numpy as jnp

from fp4jax import recipes
from fp4jax.llama import linears
from fp4jax.audit import trace
from fp4jax.numerics import tiles

ROLES = {"fprop": "Fprop", "dgrad": "Dgrad", "wgrad": "Wgrad"}
_BLOCK = re.compile(r"block_(\d+)/(.+)")
_LINEARS = {layer.path for layer in linears.BLOCK}
_ROUNDING = {"nearest": "RNE", "stochastic": "SR", "stochastic_dither": "SR 3/4-dither"}
_FAMILY = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8"}
_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


@dataclasses.dataclass
class Row:
  """One GEMM: layer, role, operands as run and as asked (lhs, rhs in the role's
  order: Fprop X, W; Dgrad dY, W; Wgrad X, dY), its precision class, FLOPs and
  what differs (empty when it matches)."""
  layer: str
  role: str
  recomputed: bool
  lhs: object          # trace.Operand
  rhs: object
  want: object         # recipes.Gemm asked for
  want_recipe: str     # who asks it: the recipe's name, "bf16_layers pin", ...
  kernel: str
  precision: str
  flops: int
  mismatch: list


def operand_text(op) -> str:
  """A realized operand in words: format, block, scale rule, rounding, rotation."""
  if op.quant:
    text = " + ".join(sorted(spec_text(s) for s in op.quant))
    if op.raw:
      text += " mixed with unquantized data"
  else:
    text = f"{_DTYPES.get(op.dtype, op.dtype)} (unquantized)"
  for block, signs in sorted(op.rotations):
    text += f", H{block} ({signs} signs)"
  return text


def spec_text(spec) -> str:
  """A QuantSpec in words, e.g. "mxfp4 b32 E8M0-even RNE" (a trace.Kernel: its name)."""
  if isinstance(spec, trace.Kernel):
    return f"kernel {spec.name} (its format is not in the trace)"
  if spec.block is None:
    block = "per-tensor"
  elif spec.block_2d:
    block = f"{spec.block}x{spec.block} tiles"
  else:
    block = f"b{spec.block}"
  scale = {"mx": f"E8M0-{spec.scale_mode}", "nvfp4": "E4M3+FP32 scales",
           "fp8": "FP32 scale"}[spec.family]
  parts = [spec.fmt, block, scale, _ROUNDING[spec.rounding]]
  if spec.block_scale != "amax":
    parts.append(spec.block_scale)
  if spec.is_random and (spec.sr_bits, spec.sr_round_up_scale) != (24, 1.0):
    parts.append(f"sr_bits={spec.sr_bits} up x{spec.sr_round_up_scale}")
  return " ".join(parts)


def _realized_spec(spec):
  """A recipe's QuantSpec as its quantizer's scope names it (2D tiles are 1D blocks of
  their flattened tiles: fp4jax.numerics.tiles)."""
  return tiles.tile_spec(spec) if spec.block_2d else spec


def _differences(name, op, spec, rotation):
  """What differs between a realized operand and (spec, rotation) asked for."""
  out = []
  want_quant = frozenset() if spec is None else frozenset({_realized_spec(spec)})
  want = "unquantized" if spec is None else spec_text(spec)
  kernels = {q for q in op.quant if isinstance(q, trace.Kernel)}
  if kernels and spec is not None and op.quant == kernels and not op.raw:
    want_quant = op.quant  # a quantizer kernel: quantized, its format unseen (docs/audit.md)
  if op.quant != want_quant or (spec is not None and op.raw):
    out.append(f"{name}: asked {want}, ran {operand_text(op)}")
  want_rot = frozenset() if rotation is None else frozenset({(rotation.block, rotation.signs)})
  if op.rotations != want_rot:
    asked = "no rotation" if rotation is None else f"H{rotation.block} ({rotation.signs} signs)"
    ran = ", ".join(f"H{b} ({s} signs)" for b, s in sorted(op.rotations)) or "no rotation"
    out.append(f"{name}: asked {asked}, ran {ran}")
  return out


def _precision(lhs, rhs) -> str:
  """The precision class of a GEMM: its operands' format (family for FP8), or
  their dtype when unquantized; "A x B" when they differ."""
  if not (lhs.quant or rhs.quant):  # XLA multiplies in the wider dtype
    wide = str(jnp.promote_types(lhs.dtype, rhs.dtype))
    return _DTYPES.get(wide, wide)
  def cls(op):
    if op.raw or not op.quant:
      return _DTYPES.get(op.dtype, op.dtype)
    return "+".join(sorted({"kernel" if isinstance(s, trace.Kernel) else _FAMILY.get(s.fmt, s.fmt)
                            for s in op.quant}))
  a, b = cls(lhs), cls(rhs)
  return a if a == b else f"{a} x {b}"


def _kernel(gemm) -> str:
  dt = lambda d: _DTYPES.get(d, d)
  return f"{gemm.prim} {dt(gemm.lhs.dtype)}x{dt(gemm.rhs.dtype)}->{dt(gemm.out_dtype)}"


def _attention_products(gemms) -> dict:
  """{label of a forward GEMM: "qk" or "pv"} for attention's plain products: in an
  ".../attn" scope with two forward GEMMs, PV is the one whose lhs is built from
  the other's output."""
  forward = collections.defaultdict(list)
  for g in gemms:
    if not g.backward and not g.recomputed:
      forward[g.path].append(g)
  out = {}
  for path, pair in forward.items():
    if path.endswith("attn") and len(pair) == 2:
      qk, pv = pair
      if ("gemm", qk.label, False) in pv.lhs.data:
        out[qk.label], out[pv.label] = "qk", "pv"
  return out


def _assign(gemms):
  """[(gemm, forward gemm it belongs to or None, role, (X-like operand, W-like operand))]."""
  forward = collections.defaultdict(list)
  for g in gemms:
    if not g.backward:
      forward[g.path].append(g)
  out = []
  for g in gemms:
    if not g.backward:
      out.append((g, g, "fprop", (g.lhs, g.rhs)))
      continue
    found = None
    for f in forward.get(g.path, []):
      for role, ref in (("dgrad", f.rhs.data), ("wgrad", f.lhs.data)):
        if g.lhs.data == ref:
          found = (f, role, (g.rhs, g.lhs) if role == "dgrad" else (g.lhs, g.rhs))
        elif g.rhs.data == ref:
          found = (f, role, (g.lhs, g.rhs) if role == "dgrad" else (g.rhs, g.lhs))
        if found:
          break
      if found:
        break
    if found is None:
      out.append((g, None, "backward (unmatched)", (g.lhs, g.rhs)))
    else:
      out.append((g, found[0], found[1], found[2]))
  return out


def expected(layer: str, model_cfg, recipe):
  """(Recipe, why) of the GEMMs of `layer` (a module path): the run's recipe, the
  "bf16" recipe for a layer bf16_layers pins, or unquantized for the GEMMs the
  model keeps in its compute dtype."""
  plain = recipes.recipe("bf16")
  match = _BLOCK.fullmatch(layer)
  block, inner = (int(match.group(1)), match.group(2)) if match else (None, layer)
  if layer.startswith("blocks/"):  # scanned blocks: one recipe for all of them
    inner = layer.split("/", 1)[1]
  pinned = block is not None and model_cfg.is_bf16(block)
  on_recipe = (plain, "bf16_layers pin") if pinned else (recipe, recipe.name)
  if inner in _LINEARS:
    return on_recipe
  if inner in ("attn/qk", "attn/pv"):
    return on_recipe if model_cfg.quantize_attention else (plain, "unquantized by the model")
  if layer == "head" and model_cfg.quantize_head:
    return (plain, "bf16_layers pin") if model_cfg.is_bf16(None) else (recipe, recipe.name)
  return plain, "unquantized by the model"


def audit(gemms, model_cfg, recipe, switch_wgrad_to=None):
  """The Rows of a train step's gemms (module docstring)."""
  products = _attention_products(gemms)
  rows = []
  for g, f, role, (x, w) in _assign(gemms):
    product = products.get(f.label) if f is not None else None
    layer = f"{g.path}/{product}" if product else g.path
    asked, label = expected(layer, model_cfg, recipe)
    if role in ROLES:
      want = getattr(asked, role)
      if g.alternative and role == "wgrad" and switch_wgrad_to is not None:
        want, label = switch_wgrad_to, "adaptive Wgrad switch"
      mismatch = (_differences("lhs", x, want.lhs, want.hadamard)
                  + _differences("rhs", w, want.rhs, want.hadamard))
    else:
      want = None
      mismatch = ["a backward GEMM that matches no forward GEMM of its layer"]
    rows.append(Row(layer=layer, role=ROLES.get(role, role), recomputed=g.recomputed,
                    lhs=x, rhs=w, want=want, want_recipe=label, kernel=_kernel(g),
                    precision=_precision(x, w), flops=g.flops, mismatch=mismatch))
  return rows


def flop_shares(rows) -> dict:
  """{precision class: fraction of the step's GEMM FLOPs}, largest first (a class
  with no FLOPs, as the adaptive switch's branch has, left out)."""
  total = sum(r.flops for r in rows) or 1
  by = collections.Counter()
  for r in rows:
    by[r.precision] += r.flops
  return dict(sorted(((k, v / total) for k, v in by.items() if v), key=lambda kv: -kv[1]))


def summary(rows) -> str:
  """One line: GEMMs, FLOP shares, mismatches."""
  shares = ", ".join(f"{v:.1%} {k}" for k, v in flop_shares(rows).items())
  bad = sum(1 for r in rows if r.mismatch)
  return f"{len(rows)} GEMMs, FLOPs {shares}; {bad} mismatch{'es' if bad != 1 else ''}"


_OPERANDS = {"Fprop": ("X", "W"), "Dgrad": ("dY", "W"), "Wgrad": ("X", "dY")}
_ORDER = [layer.path for layer in linears.BLOCK] + ["attn/qk", "attn/pv"]


def _sort_key(row):
  """Blocks in order (their linears as fp4jax.llama.linears lists them, then attention's
  products), the head last; Fprop, Dgrad, Wgrad."""
  match = _BLOCK.fullmatch(row.layer)
  inner = match.group(2) if match else row.layer.removeprefix("blocks/")
  block = int(match.group(1)) if match else (1 << 30 if row.layer == "head" else -1)
  at = _ORDER.index(inner) if inner in _ORDER else len(_ORDER)
  return (block, at, row.layer, list(ROLES.values()).index(row.role)
          if row.role in ROLES.values() else 3, row.recomputed)


def table(rows) -> str:
  """The report, two lines per GEMM in model order: layer, role, precision, share of
  the step's GEMM FLOPs, the recipe asked, ok or what differs; then the operands
  as they ran and the GEMM's primitive and dtypes. The FLOP shares close it."""
  total = sum(r.flops for r in rows) or 1
  lines = []
  for r in sorted(rows, key=_sort_key):
    role = r.role + (" (recomputed)" if r.recomputed else "")
    status = "ok" if not r.mismatch else "MISMATCH: " + "; ".join(r.mismatch)
    a, b = _OPERANDS.get(r.role, ("lhs", "rhs"))
    lines.append(f"{r.layer:<17} {role:<18} {r.precision:<11} {r.flops / total:6.2%}  "
                 f"{r.want_recipe}: {status}")
    lines.append(f"    {a}: {operand_text(r.lhs)} | {b}: {operand_text(r.rhs)} | {r.kernel}")
  lines.append("FLOPs by precision: " + ", ".join(
      f"{k} {v:.1%}" for k, v in flop_shares(rows).items()))
  return "\n".join(lines)
