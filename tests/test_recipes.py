"""Recipes: presets, validation, ConfigDict round trips and command-line overrides."""

from absl import flags
import ml_collections
from ml_collections import config_flags
import pytest

from fp4jax import recipes
from fp4jax.formats import QuantSpec
from fp4jax.recipes import Gemm, Hadamard, Recipe

ISSUE_PRESETS = ("bf16", "fp8", "mxfp8", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4",
                 "mxfp4-sr", "mxfp4-rh16", "mxfp4-dh16", "mxfp4-dh32", "mxfp4-dh16-even",
                 "tseng", "quartet", "nvfp4")


def test_every_issue_preset_exists():
  assert sorted(recipes.recipe_names()) == sorted(ISSUE_PRESETS)
  for name in recipes.recipe_names():
    assert recipes.recipe(name).name == name


def test_unknown_preset_lists_valid_names():
  with pytest.raises(ValueError) as e:
    recipes.recipe("mxfp4-dh17")
  assert "mxfp4-dh17" in str(e.value)
  for name in ISSUE_PRESETS:
    assert name in str(e.value)


def test_preset_contents():
  mx = QuantSpec("mxfp4")
  r = recipes.recipe("mxfp4-dh16")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(mx, mx, Hadamard(16, "none"))
  assert recipes.recipe("mxfp4-dh16-even").wgrad.lhs.scale_mode == "even"
  assert recipes.recipe("mxfp4-dh32").dgrad.hadamard.block == 32
  fp8 = recipes.recipe("fp8")
  # Operand order: fprop (x, w), dgrad (dy, w), wgrad (x, dy).
  assert (fp8.fprop.lhs.fmt, fp8.fprop.rhs.fmt) == ("fp8_e4m3", "fp8_e4m3")
  assert (fp8.dgrad.lhs.fmt, fp8.dgrad.rhs.fmt) == ("fp8_e5m2", "fp8_e4m3")
  assert (fp8.wgrad.lhs.fmt, fp8.wgrad.rhs.fmt) == ("fp8_e4m3", "fp8_e5m2")
  assert recipes.recipe("mxfp4-fprop").dgrad == fp8.dgrad
  assert recipes.recipe("mxfp4-fprop-dgrad").dgrad == Gemm(mx, mx)
  assert recipes.recipe("mxfp4-fprop-dgrad").wgrad == fp8.wgrad
  assert recipes.recipe("mxfp8").wgrad.rhs == QuantSpec("mxfp8_e4m3", scale_mode="rceil")
  sr = recipes.recipe("mxfp4-sr")
  assert sr.fprop == Gemm(mx, mx)
  assert {s.rounding for g in (sr.dgrad, sr.wgrad) for s in (g.lhs, g.rhs)} == {"stochastic"}
  assert recipes.recipe("mxfp4-rh16").wgrad.hadamard == Hadamard(16, "random")
  tseng = recipes.recipe("tseng")
  assert tseng.fprop.is_plain
  assert tseng.wgrad.lhs.rounding == "stochastic_dither"
  assert tseng.dgrad.hadamard == Hadamard(64, "random")
  quartet = recipes.recipe("quartet")
  assert quartet.fprop == Gemm(mx, mx, Hadamard(32, "none"))
  assert quartet.wgrad.hadamard == Hadamard(32, "random")
  assert quartet.dgrad.rhs.rounding == "stochastic"
  nv = recipes.recipe("nvfp4")
  assert nv.fprop.hadamard is None and nv.dgrad.hadamard is None
  assert nv.wgrad.hadamard == Hadamard(16, "fixed")
  assert (nv.dgrad.lhs.rounding, nv.dgrad.rhs.rounding) == ("stochastic", "nearest")
  assert (nv.wgrad.lhs.rounding, nv.wgrad.rhs.rounding) == ("nearest", "stochastic")


def test_is_random_and_is_plain():
  random = {"mxfp4-sr", "mxfp4-rh16", "tseng", "quartet", "nvfp4"}
  for name in recipes.recipe_names():
    assert recipes.recipe(name).is_random == (name in random), name
    assert recipes.recipe(name).is_plain == (name == "bf16"), name


def test_validation():
  for bad in (12, 0, True, 16.0):
    with pytest.raises(ValueError, match="power of two"):
      Hadamard(bad)
  with pytest.raises(ValueError, match="signs"):
    Hadamard(16, "sometimes")
  with pytest.raises(ValueError, match="seed"):
    Hadamard(16, "fixed", seed=1.5)
  with pytest.raises(ValueError, match="compute_dtype"):
    Recipe("x", compute_dtype="float16")
  with pytest.raises(ValueError, match="backend"):
    Recipe("x", backend="cuda")


def test_config_round_trip_every_preset():
  for name in recipes.recipe_names():
    r = recipes.recipe(name)
    assert recipes.from_config(r.to_config()) == r
    assert recipes.from_config(recipes.config_template(name)) == r


def test_overrides_and_round_trip():
  cfg = recipes.config_template("mxfp4-dh16")
  cfg.wgrad.hadamard.block = 32
  cfg.dgrad.lhs.scale_mode = "rceil"
  cfg.fprop.rhs.fmt = "none"
  r = recipes.from_config(cfg)
  assert r.wgrad.hadamard == Hadamard(32) and r.fprop.hadamard == Hadamard(16)
  assert r.dgrad.lhs.scale_mode == "rceil" and r.dgrad.rhs.scale_mode == "floor"
  assert r.fprop.rhs is None and r.fprop.lhs == QuantSpec("mxfp4")
  assert r.name.startswith("mxfp4-dh16[") and "wgrad.hadamard.block=32" in r.name
  assert recipes.from_config(r.to_config()) == r
  cfg = recipes.config_template("mxfp4")
  cfg.wgrad.hadamard.block = 0  # no-op removal on a recipe without rotation
  cfg.fprop.hadamard.signs = "fixed"
  r = recipes.from_config(cfg)
  assert r.fprop.hadamard == Hadamard(16, "fixed") and r.wgrad.hadamard is None


def test_override_of_unquantized_operand_needs_a_format():
  cfg = recipes.config_template("tseng")
  cfg.fprop.lhs.rounding = "stochastic"
  with pytest.raises(ValueError, match="fprop.lhs.fmt"):
    recipes.from_config(cfg)
  cfg.fprop.lhs.fmt = "mxfp4"
  assert recipes.from_config(cfg).fprop.lhs == QuantSpec("mxfp4", rounding="stochastic")


def _parse(argv):
  fv = flags.FlagValues()
  config_flags.DEFINE_config_dict(
      "config", ml_collections.ConfigDict(dict(quant=recipes.config_template())),
      flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config.quant


def test_command_line_override():
  r = recipes.from_config(_parse(
      ["prog", "--config.quant.name=mxfp4-dh16", "--config.quant.wgrad.hadamard.block=32",
       "--config.quant.dgrad.rhs.rounding=stochastic", "--config.quant.compute_dtype=float32"]))
  assert r.wgrad.hadamard.block == 32 and r.fprop.hadamard.block == 16
  assert r.dgrad.rhs.rounding == "stochastic" and r.is_random
  assert r.compute_dtype == "float32"
  with pytest.raises(flags.IllegalFlagValueError):
    _parse(["prog", "--config.quant.wgrad.hadamard.block=abc"])
