"""Named arms of a study: a preset with recipe overrides, under a name of its own.

An arm is written `NAME=PRESET:KEY=VALUE,KEY=VALUE` (or `NAME=PRESET`, or just
`PRESET`, which names the arm after the preset), e.g.

  A1=mxfp4-dh16:wgrad.hadamard.signs=per-step
  A3=mxfp4-dh16:wgrad.lhs.rounding=stochastic,wgrad.rhs.rounding=stochastic

KEYs are the fields of fp4jax.recipes.config_template() below `quant`
(ROLE.OPERAND.FIELD, ROLE.hadamard.FIELD, compute_dtype, backend, residuals,
scale_mode); VALUEs are read by the field's type (int, number, true/false, text).
`parse_arms("A0=mxfp4-dh16; A1=...; fp8")` reads a semicolon-separated list.
A bad arm raises fp4jax.train.config.ConfigError naming what was given and
what is allowed.
"""

import dataclasses
import re

import ml_collections

from fp4jax import errors
from fp4jax import recipes
from fp4jax.train import config as train_config

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]*$")  # no "_": run dirs are NAME_seedN
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm: its name, its text as given, its preset and overrides
  ((dotted key below quant, typed value), ...)."""
  name: str
  spec: str
  preset: str
  overrides: tuple = ()

  def apply(self, quant):
    """Sets quant.name to the preset and the overrides on `quant` (a
    config_template(), possibly with other fields set already); returns it."""
    quant.name = self.preset
    for key, value in self.overrides:
      *path, leaf = key.split(".")
      node = quant
      for part in path:
        node = node[part]
      node[leaf] = value
    return quant

  @property
  def recipe(self) -> recipes.Recipe:
    """The resolved Recipe (compute dtype as the preset's unless overridden)."""
    return recipes.from_config(self.apply(recipes.config_template()))


def _leaves(node, prefix=""):
  out = []
  for key, value in node.items():
    if isinstance(value, ml_collections.ConfigDict):
      out += _leaves(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


_ALLOWED_KEYS = ("ROLE.OPERAND.{fmt, block_size, scale_mode, rounding, block_2d, block_scale, "
                 "sr_bits, sr_round_up_scale}, "
                 "ROLE.hadamard.{block, signs, seed}, compute_dtype, backend, residuals, "
                 f"scale_mode (ROLE: {', '.join(recipes.ROLES)}; OPERAND: "
                 f"{', '.join(recipes.OPERANDS)})")


def _value(text, field_type, where):
  if field_type is bool:
    if text.lower() in _TRUE + _FALSE:
      return text.lower() in _TRUE
    raise train_config.ConfigError(f"{where}: {text!r} is not true or false")
  if field_type is int:
    try:
      return int(text)
    except ValueError:
      raise train_config.ConfigError(f"{where}: {text!r} is not an integer") from None
  if field_type is float:
    try:
      return float(text)
    except ValueError:
      raise train_config.ConfigError(f"{where}: {text!r} is not a number") from None
  return text


def parse_arm(text) -> Arm:
  """The Arm of `NAME=PRESET:KEY=VALUE,...` (see the module docstring)."""
  text = text.strip()
  name, eq, rest = text.partition("=")
  if not eq:
    name, rest = text.split(":", 1)[0], text
  name = name.strip()
  preset, _, overrides = rest.partition(":")
  preset = preset.strip()
  where = f"arm {text!r}"
  if not _NAME.match(name):
    raise train_config.ConfigError(
        f"{where}: arm name {name!r} must be letters, digits, '.', '+' or '-' (no '_'); "
        "arms are written NAME=PRESET:KEY=VALUE,KEY=VALUE")
  if preset not in recipes.recipe_names():
    raise train_config.ConfigError(
        f"{where}: unknown preset {preset!r}{errors.did_you_mean(preset, recipes.recipe_names())}; "
        f"valid: {', '.join(recipes.recipe_names())}")
  template = recipes.config_template(preset)
  leaves = _leaves(template)
  values = []
  for item in filter(None, (i.strip() for i in overrides.split(","))):
    key, eq, value = (x.strip() for x in item.partition("="))
    if not eq or key == "name" or key not in leaves:
      raise train_config.ConfigError(
          f"{where}: override {item!r} is not KEY=VALUE with KEY one of {_ALLOWED_KEYS}")
    *path, leaf = key.split(".")
    node = template
    for part in path:
      node = node[part]
    values.append((key, _value(value, node.get_type(leaf), f"{where}: {key}")))
  arm = Arm(name, text, preset, tuple(values))
  try:
    _ = arm.recipe
  except ValueError as e:
    raise train_config.ConfigError(f"{where}: {e}") from None
  return arm


def parse_arms(text) -> list[Arm]:
  """The arms of a semicolon-separated list; duplicate names raise ConfigError."""
  arms = [parse_arm(t) for t in text.split(";") if t.strip()]
  names = [a.name for a in arms]
  if not arms:
    raise train_config.ConfigError("the list of arms is empty; write NAME=PRESET:KEY=VALUE;...")
  duplicate = sorted({n for n in names if names.count(n) > 1})
  if duplicate:
    raise train_config.ConfigError(f"arms {duplicate} are given more than once in {text!r}")
  return arms
