"""Recipes: how each of the three GEMMs of a linear layer is quantized.

A dot_general Y = X W runs three GEMMs (docs/recipes.md, its opening table):

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
role's rotation. A top-level `scale_mode` sets the E8M0 rule of every MX
operand of every role (per-operand `scale_mode`s still win), e.g.
`--config.quant.scale_mode=floor`. `from_config(cfg) -> Recipe`,
`Recipe.to_config()`.

Scale rules: the staged presets (mxfp4-fprop ... mxfp4-dh32, mxfp4-wdh16,
mxfp4-lh16, mxfp4-fh16) use AMD's `even` rule with round-to-nearest-even on
every MX operand, as the MXFP4 kernel of AMD's ROCm TransformerEngine
(`cast_transpose_mxfp4`) that arXiv 2605.09825 ran; `mxfp4-floor` and
`mxfp4-dh16-floor` are their twins under the OCP MX v1.0 `floor` rule.

Residuals (`Recipe.residuals`, `--config.quant.residuals`): "original" saves
the two operands of every dot_general for the backward, which re-quantizes
them; "quantized" saves instead the Wgrad lhs (the activations X) already
rotated and quantized along the token axis, packed (fp4jax.residuals), and
the rhs (the weight, resident anyway) as given. Gradients are bitwise those of
"original": Dgrad needs no X, and Wgrad's X is exactly what re-quantizing
would give, stochastic rounding and random signs included (the same key in
the forward and the backward). It needs a quantized Wgrad lhs in 1D blocks
(or per-tensor FP8), and an Fprop lhs without QuEST's trust mask (whose
backward needs the original X).
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from fp4jax.numerics.formats import QuantSpec
from fp4jax.numerics.hadamard import check_sign_policy

ROLES = ("fprop", "dgrad", "wgrad")
OPERANDS = ("lhs", "rhs")
COMPUTE_DTYPES = ("bfloat16", "float32")
# Names only: fp4jax.backends owns the backends and checks a recipe's choice
# against the installed jax where it is used (backends.check_recipe).
BACKENDS = ("xla", "pallas", "native", "mosaic", "mosaic_fast", "auto")
NATIVE_ROUTES = ("auto", "scaled_matmul", "scaled_dot")
RESIDUALS = ("original", "quantized")
PLAIN_ROUTES = ("lax", "float32_output")


@dataclasses.dataclass(frozen=True)
class Hadamard:
  """Block-diagonal Hadamard rotation of a GEMM's contraction axis.

  signs, one of hadamard.SIGN_POLICIES: "none" (plain Sylvester, deterministic),
  "fixed" (one +-1 vector of length `block` drawn from `seed`, the same on
  every call and layer), "per-layer" (drawn from the dot_general's
  `layer_key`: one per layer, the same every step) or "per-step" (fresh from
  the dot_general's `key` on every call). `seed` is used by "fixed" only.
  Both operands of the GEMM share the matrix and the signs, so the product is
  unchanged up to round-off.
  """

  block: int = 16
  signs: str = "none"
  seed: int = 0

  def __post_init__(self):
    if (isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1
        or self.block & (self.block - 1)):
      raise ValueError(f"Hadamard block must be a power of two, got {self.block!r}")
    check_sign_policy(self.signs)
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
    """True when the GEMM needs a fresh key per call (SR, per-step signs)."""
    specs = (s for s in (self.lhs, self.rhs) if s is not None)
    return any(s.is_random for s in specs) or self._signs_are("per-step")

  @property
  def needs_layer_key(self) -> bool:
    """True when the rotation uses per-layer signs."""
    return self._signs_are("per-layer")

  def _signs_are(self, policy):
    return self.hadamard is not None and self.hadamard.signs == policy


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Quantization of the fprop, dgrad and wgrad GEMMs (operand order above).

  compute_dtype: dtype the (rotated, dequantized) operands are cast to for the
  GEMM of a role that quantizes or rotates; plain roles run lax.dot_general
  unchanged. backend: "xla" (jnp path), "pallas" (fp4jax.kernels), "native"
  (block-scaled GEMMs, jax >= 0.11), "mosaic" (Hopper FP8 tensor cores, jax >=
  0.12) or "auto" (fp4jax.backends.resolve).
  native_route: the native backend's op, "auto" (by format),
  "scaled_matmul" or "scaled_dot" (fp4jax.backends.native).
  residuals: "original" or "quantized" (module docstring).
  plain_route: how a GEMM that neither quantizes nor rotates runs: "lax"
  (lax.dot_general with the caller's arguments, autodiff backward: bitwise an
  unquantized model) or "float32_output" (forward and backward GEMMs as
  float32-output dots rounded once to the output dtype, the route of every
  quantized GEMM; fp4jax.dot, "Plain GEMMs").
  """

  name: str
  fprop: Gemm = Gemm()
  dgrad: Gemm = Gemm()
  wgrad: Gemm = Gemm()
  compute_dtype: str = "bfloat16"
  backend: str = "xla"
  native_route: str = "auto"
  residuals: str = "original"
  plain_route: str = "lax"

  def __post_init__(self):
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"compute_dtype {self.compute_dtype!r} not in {COMPUTE_DTYPES}")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend {self.backend!r} not in {BACKENDS}")
    if self.residuals not in RESIDUALS:
      raise ValueError(f"residuals {self.residuals!r} not in {RESIDUALS}")
    if self.plain_route not in PLAIN_ROUTES:
      raise ValueError(f"plain_route {self.plain_route!r} not in {PLAIN_ROUTES}")
    if self.native_route not in NATIVE_ROUTES:
      raise ValueError(f"native_route {self.native_route!r} not in {NATIVE_ROUTES}")
    if self.residuals == "quantized":
      self._check_quantized_residuals()

  def _check_quantized_residuals(self):
    """ValueError when residuals="quantized" cannot give the default's gradients."""
    why = None
    if self.wgrad.lhs is None:
      why = "leaves wgrad.lhs unquantized; give wgrad.lhs a format"
    elif self.wgrad.lhs.block_2d:
      why = "quantizes wgrad.lhs in 2D tiles (saved residuals take 1D blocks)"
    elif self.fprop.lhs is not None and self.fprop.lhs.has_trust_mask:
      why = "masks fprop.lhs's gradient with QuEST's trust mask, which needs the original X"
    if why is not None:
      raise ValueError(f"residuals='quantized' needs a quantized Wgrad lhs the backward can "
                       f"take as saved, but recipe {self.name!r} {why}; or use "
                       "residuals='original'")

  @property
  def is_random(self) -> bool:
    """True when some role needs a fresh PRNG key per call (stochastic
    rounding, per-step signs): dot_general's `key`."""
    return any(getattr(self, r).is_random for r in ROLES)

  @property
  def needs_layer_key(self) -> bool:
    """True when some role uses per-layer signs: dot_general's `layer_key`."""
    return any(getattr(self, r).needs_layer_key for r in ROLES)

  @property
  def is_plain(self) -> bool:
    """True when no role quantizes or rotates: dot_general is lax.dot_general
    (plain_route "lax") or its float32-output form."""
    return all(getattr(self, r).is_plain for r in ROLES)

  def to_config(self) -> ml_collections.ConfigDict:
    """This recipe as a fully explicit `config_template()`; from_config inverts it."""
    cfg = config_template()
    cfg.name = self.name
    cfg.compute_dtype = self.compute_dtype
    cfg.backend = self.backend
    cfg.native_route = self.native_route
    cfg.residuals = self.residuals
    cfg.plain_route = self.plain_route
    for role in ROLES:
      gemm = getattr(self, role)
      for op in OPERANDS:
        spec, node = getattr(gemm, op), cfg[role][op]
        node.fmt = "none" if spec is None else spec.fmt
        if spec is not None:
          node.block_size = spec.block_size
          node.scale_mode = spec.scale_mode
          node.rounding = spec.rounding
          node.block_2d = spec.block_2d
          node.block_scale = spec.block_scale
          node.sr_bits = spec.sr_bits
          node.sr_round_up_scale = float(spec.sr_round_up_scale)
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
_AMD = _mx(scale_mode="even")  # AMD's MXFP4 cast: even rule, round to nearest even


def _mxfp4_all(scale_mode="even", bwd_rounding="nearest", hadamard=None,
               wgrad_hadamard=None):
  """All three GEMMs MXFP4; `hadamard` on every role, or `wgrad_hadamard` on Wgrad."""
  fwd, bwd = _mx(scale_mode=scale_mode), _mx(scale_mode=scale_mode, rounding=bwd_rounding)
  return dict(fprop=Gemm(fwd, fwd, hadamard), dgrad=Gemm(bwd, bwd, hadamard),
              wgrad=Gemm(bwd, bwd, hadamard or wgrad_hadamard))


def _four_over_six(roles):
  """roles with every operand's blocks scaled by Four over Six."""
  return {r: Gemm(*(dataclasses.replace(s, block_scale="four_over_six") for s in (g.lhs, g.rhs)),
                  g.hadamard) for r, g in roles.items()}


def _presets():
  mxfp8 = _mx("mxfp8_e4m3", scale_mode="rceil")
  nv, nv_sr = QuantSpec("nvfp4"), QuantSpec("nvfp4", rounding="stochastic")
  nv_w = QuantSpec("nvfp4", block_2d=True)  # 16x16 weight tiles: one W for Fprop and Dgrad
  nv46 = QuantSpec("nvfp4", block_scale="four_over_six")
  eden = QuantSpec("nvfp4", rounding="stochastic", block_scale="ms_eden")
  sr_dither = _mx(rounding="stochastic_dither")
  quest_fwd = QuantSpec("mxfp4", block_scale="quest")
  tseng_h = Hadamard(64, "per-step")
  quartet_bwd_h = Hadamard(32, "per-step")
  return {
      "bf16": dict(),
      "fp8": _FP8,
      "mxfp8": dict(fprop=Gemm(mxfp8, mxfp8), dgrad=Gemm(mxfp8, mxfp8),
                    wgrad=Gemm(mxfp8, mxfp8)),
      "mxfp4-fprop": dict(_FP8, fprop=Gemm(_AMD, _AMD)),
      "mxfp4-fprop-dgrad": dict(_FP8, fprop=Gemm(_AMD, _AMD), dgrad=Gemm(_AMD, _AMD)),
      "mxfp4": _mxfp4_all(),
      "mxfp4-sr": _mxfp4_all(bwd_rounding="stochastic"),
      "mxfp4-rh16": _mxfp4_all(hadamard=Hadamard(16, "per-step")),
      "mxfp4-dh16": _mxfp4_all(hadamard=Hadamard(16)),
      "mxfp4-dh32": _mxfp4_all(hadamard=Hadamard(32)),
      "mxfp4-wdh16": _mxfp4_all(wgrad_hadamard=Hadamard(16)),
      "mxfp4-lh16": _mxfp4_all(hadamard=Hadamard(16, "per-layer")),
      "mxfp4-fh16": _mxfp4_all(hadamard=Hadamard(16, "fixed")),
      "mxfp4-floor": _mxfp4_all(scale_mode="floor"),
      "mxfp4-dh16-floor": _mxfp4_all(scale_mode="floor", hadamard=Hadamard(16)),
      "tseng": dict(dgrad=Gemm(sr_dither, sr_dither, tseng_h),
                    wgrad=Gemm(sr_dither, sr_dither, tseng_h)),
      # Quartet, arXiv 2505.14669: QuEST forward after H32; backward SR (blocks
      # scaled by 3/4 first, as Tseng et al.) with signs drawn afresh each step.
      "quartet": dict(fprop=Gemm(quest_fwd, quest_fwd, Hadamard(32)),
                      dgrad=Gemm(sr_dither, sr_dither, quartet_bwd_h),
                      wgrad=Gemm(sr_dither, sr_dither, quartet_bwd_h)),
      # NVIDIA, arXiv 2509.25149 (BF16 first/last blocks: LlamaConfig.bf16_layers).
      "nvfp4": dict(fprop=Gemm(nv, nv_w), dgrad=Gemm(nv_sr, nv_w),
                    wgrad=Gemm(nv, nv_sr, Hadamard(16, "fixed"))),
      # Four over Six, arXiv 2512.02010: the NVIDIA recipe, every block 6-or-4.
      "nvfp4-4over6": _four_over_six(dict(fprop=Gemm(nv, nv_w), dgrad=Gemm(nv_sr, nv_w),
                                          wgrad=Gemm(nv, nv_sr, Hadamard(16, "fixed")))),
      # Quartet II, arXiv 2601.22813: forward NVFP4 with Four over Six; backward
      # MS-EDEN after a 128-point Hadamard with fresh signs every step.
      "quartet2": dict(fprop=Gemm(nv46, nv46), dgrad=Gemm(eden, eden, Hadamard(128, "per-step")),
                       wgrad=Gemm(eden, eden, Hadamard(128, "per-step"))),
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
  rounding, block_2d, block_scale, sr_bits, sr_round_up_scale} and
  hadamard.{block, signs, seed}; plus
  compute_dtype, backend, native_route, residuals, plain_route and scale_mode
  (the rule of every MX operand without its own scale_mode).
  """
  def operand():
    return ml_collections.ConfigDict(dict(
        fmt=config_dict.placeholder(str), block_size=config_dict.placeholder(int),
        scale_mode=config_dict.placeholder(str), rounding=config_dict.placeholder(str),
        block_2d=config_dict.placeholder(bool), block_scale=config_dict.placeholder(str),
        sr_bits=config_dict.placeholder(int),
        sr_round_up_scale=config_dict.placeholder(float)))

  def gemm():
    return ml_collections.ConfigDict(dict(
        lhs=operand(), rhs=operand(),
        hadamard=ml_collections.ConfigDict(dict(
            block=config_dict.placeholder(int), signs=config_dict.placeholder(str),
            seed=config_dict.placeholder(int)))))

  return ml_collections.ConfigDict(dict(
      name=name, compute_dtype=config_dict.placeholder(str),
      backend=config_dict.placeholder(str), native_route=config_dict.placeholder(str),
      residuals=config_dict.placeholder(str), plain_route=config_dict.placeholder(str),
      scale_mode=config_dict.placeholder(str),
      fprop=gemm(), dgrad=gemm(), wgrad=gemm()))


def _given(node) -> dict:
  return {k: v for k, v in node.items() if v is not None}


def _override_spec(spec, node, where, scale_mode=None):
  """spec with node's fields; scale_mode (recipe-wide) applies to MX results
  whose node gives none and whose scale comes from the block amax (QuEST's
  exponent is its own)."""
  spec = _override_fields(spec, _given(node), where)
  if scale_mode is not None and spec in _mx_specs_of([spec]) and node.scale_mode is None:
    spec = dataclasses.replace(spec, scale_mode=scale_mode)
  return spec


def _override_fields(spec, fields, where):
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


def from_config(cfg: ml_collections.ConfigDict, default_compute_dtype=None) -> Recipe:
  """Recipe from `config_template()`: the preset `cfg.name` with the given overrides.

  The name of an overridden recipe records the changes, e.g.
  "mxfp4-dh16[wgrad.hadamard.block=32]" or "mxfp4[scale_mode=floor]" (when
  every MX operand moved to one rule); such a name is accepted back.
  default_compute_dtype: the compute dtype when cfg sets none (a run's
  config.dtype; not part of the name). A recipe-wide scale_mode on a recipe
  without MX operands raises ValueError.
  """
  base = recipe(_base_name(cfg.name))
  scale_mode = cfg.get("scale_mode")
  roles = {}
  for role in ROLES:
    gemm = getattr(base, role)
    roles[role] = Gemm(
        *(_override_spec(getattr(gemm, op), cfg[role][op], f"{role}.{op}", scale_mode)
          for op in OPERANDS),
        _override_hadamard(gemm.hadamard, cfg[role].hadamard))
  out = Recipe(base.name, **roles, **_given(
      dict(compute_dtype=cfg.compute_dtype, backend=cfg.backend,
           native_route=cfg.get("native_route"), residuals=cfg.get("residuals"),
           plain_route=cfg.get("plain_route"))))
  if scale_mode is not None and not _mx_specs(out):
    raise ValueError(f"quant.scale_mode={scale_mode!r} sets the E8M0 rule of MX operands; "
                     f"recipe {cfg.name!r} has none")
  changes = _name_changes(_diff(base.to_config(), out.to_config()), out)
  if changes:
    out = dataclasses.replace(out, name=f"{base.name}[{','.join(changes)}]")
  if cfg.compute_dtype is None and default_compute_dtype is not None:
    out = dataclasses.replace(out, compute_dtype=default_compute_dtype)
  return out


def _mx_specs(r: Recipe) -> list:
  """The MX QuantSpecs of r's operands with amax-based scales, role by role."""
  return _mx_specs_of(getattr(getattr(r, role), op) for role in ROLES for op in OPERANDS)


def _mx_specs_of(specs) -> list:
  """The specs (None allowed) that follow an E8M0 scale rule."""
  return [s for s in specs if s is not None and s.family == "mx" and s.block_scale == "amax"]


def _name_changes(changes, out):
  """changes, with the scale_mode entries as one `scale_mode=X` when every MX
  operand of `out` has rule X (a recipe-wide change)."""
  modes = {s.scale_mode for s in _mx_specs(out)}
  moved = [c for c in changes if c.split("=", 1)[0].endswith(".scale_mode")]
  if not moved or len(modes) != 1:
    return changes
  return [c for c in changes if c not in moved] + [f"scale_mode={modes.pop()}"]


def _diff(a, b, prefix=""):
  """Dotted `key=value` entries of flat config b that differ from a (name excluded).

  A removed operand (fmt=none) or rotation (block=0) is one entry.
  """
  for key, removed in (("fmt", "none"), ("block", 0)):
    if key in b and b[key] == removed:
      return [] if a[key] == removed else [f"{prefix}{key}={removed}"]
  out = []
  for k in b:
    if k == "name":
      continue
    if isinstance(b[k], ml_collections.ConfigDict):
      out += _diff(a[k], b[k], f"{prefix}{k}.")
    elif a[k] != b[k]:
      out.append(f"{prefix}{k}={b[k]}")
  return out
