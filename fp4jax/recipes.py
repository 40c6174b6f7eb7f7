"""Recipes: how each of the three GEMMs of a linear layer is quantized.

A dot_general Y = X W runs three GEMMs (architecture.md, "Roles and axes"):

  fprop  Y  = X W      lhs = X,  rhs = W,  contraction over K
  dgrad  dX = dY W^T   lhs = dY, rhs = W,  contraction over N
  wgrad  dW = X^T dY   lhs = X,  rhs = dY, contraction over M (all token axes)

A `Gemm` gives each of its two operands a `QuantSpec` (or None: left in the
compute dtype) and an optional `Hadamard` rotation applied to both operands
along that GEMM's contraction axis. A `Recipe` holds the three Gemms, the
compute dtype of the dequantized GEMM (accumulation is always float32) and the
quantization backend. Named presets: `recipe(name)`, `recipe_names()`.

Config: `config_template()` is an ml_collections ConfigDict with `name` (the
preset) and typed placeholders for every field of every role (None keeps the
preset), so `--config.quant.wgrad.hadamard.block=32` works from the command
line. `fmt="none"` removes an operand's quantization, `hadamard.block=0` a
role's rotation. `from_config(cfg) -> Recipe`, `Recipe.to_config()`.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from fp4jax import backends
from fp4jax.formats import QuantSpec

ROLES = ("fprop", "dgrad", "wgrad")
OPERANDS = ("lhs", "rhs")
SIGN_POLICIES = ("none", "fixed", "random")
COMPUTE_DTYPES = ("bfloat16", "float32")
BACKENDS = backends.NAMES + ("auto",)


@dataclasses.dataclass(frozen=True)
class Hadamard:
  """Block-diagonal Hadamard rotation of a GEMM's contraction axis.

  signs: "none" (plain Sylvester, deterministic), "fixed" (one +-1 vector of
  length `block` drawn from `seed`, the same on every call) or "random" (fresh
  signs from the dot_general's key on every call). Both operands of the GEMM
  share the matrix and the signs, so the product is unchanged up to round-off.
  """

  block: int = 16
  signs: str = "none"
  seed: int = 0

  def __post_init__(self):
    if (isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1
        or self.block & (self.block - 1)):
      raise ValueError(f"Hadamard block must be a power of two, got {self.block!r}")
    if self.signs not in SIGN_POLICIES:
      raise ValueError(f"Hadamard signs {self.signs!r} not in {SIGN_POLICIES}")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"Hadamard seed must be an int, got {self.seed!r}")


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One GEMM: a QuantSpec (or None) per operand and an optional rotation."""

  lhs: QuantSpec | None = None
  rhs: QuantSpec | None = None
  hadamard: Hadamard | None = None

  @property
  def is_plain(self) -> bool:
    """True when the GEMM neither quantizes nor rotates (plain lax.dot_general)."""
    return self.lhs is None and self.rhs is None and self.hadamard is None

  @property
  def is_random(self) -> bool:
    specs = (s for s in (self.lhs, self.rhs) if s is not None)
    return any(s.is_random for s in specs) or (
        self.hadamard is not None and self.hadamard.signs == "random")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Quantization of the fprop, dgrad and wgrad GEMMs (operand order above).

  compute_dtype: dtype the (rotated, dequantized) operands are cast to for the
  GEMM of a role that quantizes or rotates; plain roles run lax.dot_general
  unchanged. backend: "xla" (jnp path), "pallas" (fp4jax.kernels), "native"
  (block-scaled GEMMs, jax >= 0.11) or "auto" (fp4jax.backends.resolve).
  """

  name: str
  fprop: Gemm = Gemm()
  dgrad: Gemm = Gemm()
  wgrad: Gemm = Gemm()
  compute_dtype: str = "bfloat16"
  backend: str = "xla"

  def __post_init__(self):
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"compute_dtype {self.compute_dtype!r} not in {COMPUTE_DTYPES}")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend {self.backend!r} not in {BACKENDS}")
    backends.check_jax(self.backend)

  @property
  def is_random(self) -> bool:
    """True when some role needs a PRNG key (stochastic rounding, random signs)."""
    return any(getattr(self, r).is_random for r in ROLES)

  @property
  def is_plain(self) -> bool:
    """True when no role quantizes or rotates: dot_general is lax.dot_general."""
    return all(getattr(self, r).is_plain for r in ROLES)

  def to_config(self) -> ml_collections.ConfigDict:
    """This recipe as a fully explicit `config_template()`; from_config inverts it."""
    cfg = config_template()
    cfg.name = self.name
    cfg.compute_dtype = self.compute_dtype
    cfg.backend = self.backend
    for role in ROLES:
      gemm = getattr(self, role)
      for op in OPERANDS:
        spec, node = getattr(gemm, op), cfg[role][op]
        node.fmt = "none" if spec is None else spec.fmt
        if spec is not None:
          node.block_size = spec.block_size
          node.scale_mode = spec.scale_mode
          node.rounding = spec.rounding
      h, node = gemm.hadamard, cfg[role].hadamard
      node.block = 0 if h is None else h.block
      if h is not None:
        node.signs, node.seed = h.signs, h.seed
    return cfg


# ---------------------------------------------------------------- presets

def _mx(fmt="mxfp4", scale_mode="floor", rounding="nearest"):
  return QuantSpec(fmt, scale_mode=scale_mode, rounding=rounding)


_E4M3, _E5M2 = QuantSpec("fp8_e4m3"), QuantSpec("fp8_e5m2")
_FP8 = dict(fprop=Gemm(_E4M3, _E4M3), dgrad=Gemm(_E5M2, _E4M3), wgrad=Gemm(_E4M3, _E5M2))


def _mxfp4_all(scale_mode="floor", bwd_rounding="nearest", hadamard=None):
  fwd, bwd = _mx(scale_mode=scale_mode), _mx(scale_mode=scale_mode, rounding=bwd_rounding)
  return dict(fprop=Gemm(fwd, fwd, hadamard), dgrad=Gemm(bwd, bwd, hadamard),
              wgrad=Gemm(bwd, bwd, hadamard))


def _presets():
  mxfp4 = _mx()
  mxfp8 = _mx("mxfp8_e4m3", scale_mode="rceil")
  nv, nv_sr = QuantSpec("nvfp4"), QuantSpec("nvfp4", rounding="stochastic")
  sr_dither = _mx(rounding="stochastic_dither")
  sr = _mx(rounding="stochastic")
  tseng_h = Hadamard(64, "random")
  quartet_bwd_h = Hadamard(32, "random")
  return {
      "bf16": dict(),
      "fp8": _FP8,
      "mxfp8": dict(fprop=Gemm(mxfp8, mxfp8), dgrad=Gemm(mxfp8, mxfp8),
                    wgrad=Gemm(mxfp8, mxfp8)),
      "mxfp4-fprop": dict(_FP8, fprop=Gemm(mxfp4, mxfp4)),
      "mxfp4-fprop-dgrad": dict(_FP8, fprop=Gemm(mxfp4, mxfp4), dgrad=Gemm(mxfp4, mxfp4)),
      "mxfp4": _mxfp4_all(),
      "mxfp4-sr": _mxfp4_all(bwd_rounding="stochastic"),
      "mxfp4-rh16": _mxfp4_all(hadamard=Hadamard(16, "random")),
      "mxfp4-dh16": _mxfp4_all(hadamard=Hadamard(16)),
      "mxfp4-dh16-even": _mxfp4_all(scale_mode="even", hadamard=Hadamard(16)),
      "mxfp4-dh32": _mxfp4_all(hadamard=Hadamard(32)),
      "tseng": dict(dgrad=Gemm(sr_dither, sr_dither, tseng_h),
                    wgrad=Gemm(sr_dither, sr_dither, tseng_h)),
      "quartet": dict(fprop=Gemm(mxfp4, mxfp4, Hadamard(32)),
                      dgrad=Gemm(sr, sr, quartet_bwd_h), wgrad=Gemm(sr, sr, quartet_bwd_h)),
      "nvfp4": dict(fprop=Gemm(nv, nv), dgrad=Gemm(nv_sr, nv),
                    wgrad=Gemm(nv, nv_sr, Hadamard(16, "fixed"))),
  }


_PRESETS = _presets()


def recipe_names() -> list[str]:
  """Names of the presets, in the order of the README table."""
  return list(_PRESETS)


def recipe(name: str) -> Recipe:
  """The named preset; unknown names raise ValueError listing the valid ones."""
  if name not in _PRESETS:
    raise ValueError(f"unknown recipe {name!r}; valid names: {', '.join(_PRESETS)}")
  return Recipe(name, **_PRESETS[name])


# ---------------------------------------------------------------- config

def config_template(name: str = "bf16") -> ml_collections.ConfigDict:
  """ConfigDict: `name` (a preset) plus typed None placeholders (keep the preset).

  Per role (fprop, dgrad, wgrad): lhs/rhs.{fmt, block_size, scale_mode,
  rounding} and hadamard.{block, signs, seed}; plus compute_dtype and backend.
  """
  def operand():
    return ml_collections.ConfigDict(dict(
        fmt=config_dict.placeholder(str), block_size=config_dict.placeholder(int),
        scale_mode=config_dict.placeholder(str), rounding=config_dict.placeholder(str)))

  def gemm():
    return ml_collections.ConfigDict(dict(
        lhs=operand(), rhs=operand(),
        hadamard=ml_collections.ConfigDict(dict(
            block=config_dict.placeholder(int), signs=config_dict.placeholder(str),
            seed=config_dict.placeholder(int)))))

  return ml_collections.ConfigDict(dict(
      name=name, compute_dtype=config_dict.placeholder(str),
      backend=config_dict.placeholder(str), fprop=gemm(), dgrad=gemm(), wgrad=gemm()))


def _given(node) -> dict:
  return {k: v for k, v in node.items() if v is not None}


def _override_spec(spec, node, where):
  fields = _given(node)
  if fields.get("fmt") == "none" or (spec is None and not fields):
    return None
  if spec is None:
    if "fmt" not in fields:
      raise ValueError(f"{where} is not quantized in the preset; set {where}.fmt "
                       f"to give it a format (got {fields})")
    return QuantSpec(**fields)
  return dataclasses.replace(spec, **fields)


def _override_hadamard(h, node):
  fields = _given(node)
  if fields.get("block") == 0:
    return None
  return dataclasses.replace(h or Hadamard(), **fields) if fields else h


def _base_name(name: str) -> str:
  return name.split("[", 1)[0]


def from_config(cfg: ml_collections.ConfigDict) -> Recipe:
  """Recipe from `config_template()`: the preset `cfg.name` with the given overrides.

  The name of an overridden recipe records the changes, e.g.
  "mxfp4-dh16[wgrad.hadamard.block=32]"; such a name is accepted back.
  """
  base = recipe(_base_name(cfg.name))
  roles = {}
  for role in ROLES:
    gemm = getattr(base, role)
    roles[role] = Gemm(
        *(_override_spec(getattr(gemm, op), cfg[role][op], f"{role}.{op}") for op in OPERANDS),
        _override_hadamard(gemm.hadamard, cfg[role].hadamard))
  out = Recipe(base.name, **roles, **_given(
      dict(compute_dtype=cfg.compute_dtype, backend=cfg.backend)))
  changes = _diff(base.to_config(), out.to_config())
  return dataclasses.replace(out, name=f"{base.name}[{','.join(changes)}]") if changes else out


def _diff(a, b, prefix=""):
  """Dotted `key=value` entries of flat config b that differ from a (name excluded)."""
  out = []
  for k in b:
    if k == "name":
      continue
    if isinstance(b[k], ml_collections.ConfigDict):
      out += _diff(a[k], b[k], f"{prefix}{k}.")
    elif a[k] != b[k]:
      out.append(f"{prefix}{k}={b[k]}")
  return out
