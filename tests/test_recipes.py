"""Recipes: presets, validation, ConfigDict round trips and command-line overrides."""

import dataclasses

from absl import flags
import ml_collections
from ml_collections import config_flags
import pytest

from fp4jax import recipes
from fp4jax.numerics.formats import QuantSpec
from fp4jax.recipes import Gemm, Hadamard, Recipe

ISSUE_PRESETS = ("bf16", "fp8", "mxfp8", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4",
                 "mxfp4-sr", "mxfp4-rh16", "mxfp4-dh16", "mxfp4-dh32", "mxfp4-wdh16",
                 "mxfp4-lh16", "mxfp4-fh16", "mxfp4-floor", "mxfp4-dh16-floor",
                 "tseng", "quartet", "nvfp4", "nvfp4-4over6", "quartet2")
AMD = QuantSpec("mxfp4", scale_mode="even")  # AMD's cast: even rule, nearest rounding


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
  mx, even = QuantSpec("mxfp4"), AMD
  r = recipes.recipe("mxfp4-dh16")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(even, even, Hadamard(16, "none"))
  r = recipes.recipe("mxfp4-dh16-floor")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(mx, mx, Hadamard(16, "none"))
  r = recipes.recipe("mxfp4-floor")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(mx, mx)
  assert recipes.recipe("mxfp4").wgrad == Gemm(even, even)
  assert recipes.recipe("mxfp4-dh32").dgrad == Gemm(even, even, Hadamard(32))
  r = recipes.recipe("mxfp4-wdh16")
  assert r.fprop == r.dgrad == Gemm(even, even) and r.wgrad == Gemm(even, even, Hadamard(16))
  r = recipes.recipe("mxfp4-lh16")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(even, even, Hadamard(16, "per-layer"))
  r = recipes.recipe("mxfp4-fh16")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(even, even, Hadamard(16, "fixed"))
  fp8 = recipes.recipe("fp8")
  # Operand order: fprop (x, w), dgrad (dy, w), wgrad (x, dy).
  assert (fp8.fprop.lhs.fmt, fp8.fprop.rhs.fmt) == ("fp8_e4m3", "fp8_e4m3")
  assert (fp8.dgrad.lhs.fmt, fp8.dgrad.rhs.fmt) == ("fp8_e5m2", "fp8_e4m3")
  assert (fp8.wgrad.lhs.fmt, fp8.wgrad.rhs.fmt) == ("fp8_e4m3", "fp8_e5m2")
  assert recipes.recipe("mxfp4-fprop").fprop == Gemm(even, even)
  assert recipes.recipe("mxfp4-fprop").dgrad == fp8.dgrad
  assert recipes.recipe("mxfp4-fprop-dgrad").dgrad == Gemm(even, even)
  assert recipes.recipe("mxfp4-fprop-dgrad").wgrad == fp8.wgrad
  assert recipes.recipe("mxfp8").wgrad.rhs == QuantSpec("mxfp8_e4m3", scale_mode="rceil")
  sr = recipes.recipe("mxfp4-sr")
  assert sr.fprop == Gemm(even, even)
  assert {s.rounding for g in (sr.dgrad, sr.wgrad) for s in (g.lhs, g.rhs)} == {"stochastic"}
  assert {s.scale_mode for g in (sr.dgrad, sr.wgrad) for s in (g.lhs, g.rhs)} == {"even"}
  r = recipes.recipe("mxfp4-rh16")
  assert r.fprop == r.dgrad == r.wgrad == Gemm(even, even, Hadamard(16, "per-step"))
  tseng = recipes.recipe("tseng")
  assert tseng.fprop.is_plain
  assert tseng.wgrad.lhs.rounding == "stochastic_dither"
  assert tseng.dgrad.hadamard == Hadamard(64, "per-step")
  quartet = recipes.recipe("quartet")
  quest = QuantSpec("mxfp4", block_scale="quest")
  assert quartet.fprop == Gemm(quest, quest, Hadamard(32, "none"))
  assert quartet.wgrad.hadamard == Hadamard(32, "per-step")
  assert quartet.dgrad.rhs.rounding == "stochastic_dither"
  nv = recipes.recipe("nvfp4")
  assert nv.fprop.hadamard is None and nv.dgrad.hadamard is None
  assert nv.wgrad.hadamard == Hadamard(16, "fixed")
  assert (nv.dgrad.lhs.rounding, nv.dgrad.rhs.rounding) == ("stochastic", "nearest")
  assert (nv.wgrad.lhs.rounding, nv.wgrad.rhs.rounding) == ("nearest", "stochastic")
  assert nv.fprop.rhs == nv.dgrad.rhs == QuantSpec("nvfp4", block_2d=True)
  n46 = recipes.recipe("nvfp4-4over6")
  for role in ("fprop", "dgrad", "wgrad"):
    a, b = getattr(n46, role), getattr(nv, role)
    assert a.hadamard == b.hadamard and (a.lhs, a.rhs) == tuple(
        dataclasses.replace(spec, block_scale="four_over_six") for spec in (b.lhs, b.rhs))
  q2 = recipes.recipe("quartet2")
  eden = QuantSpec("nvfp4", rounding="stochastic", block_scale="ms_eden")
  assert q2.fprop.lhs == q2.fprop.rhs == QuantSpec("nvfp4", block_scale="four_over_six")
  assert q2.fprop.hadamard is None
  assert q2.dgrad == q2.wgrad == Gemm(eden, eden, Hadamard(128, "per-step"))
  assert not (nv.fprop.lhs.block_2d or nv.dgrad.lhs.block_2d or nv.wgrad.lhs.block_2d
              or nv.wgrad.rhs.block_2d)


def test_is_random_needs_layer_key_and_is_plain():
  random = {"mxfp4-sr", "mxfp4-rh16", "tseng", "quartet", "nvfp4", "nvfp4-4over6", "quartet2"}
  for name in recipes.recipe_names():
    assert recipes.recipe(name).is_random == (name in random), name
    assert recipes.recipe(name).needs_layer_key == (name == "mxfp4-lh16"), name
    assert recipes.recipe(name).is_plain == (name == "bf16"), name


def test_validation():
  for bad in (12, 0, True, 16.0):
    with pytest.raises(ValueError, match="power of two"):
      Hadamard(bad)
  with pytest.raises(ValueError, match="'sometimes' is not one of none, fixed, per-layer, "
                     "per-step"):
    Hadamard(16, "sometimes")
  with pytest.raises(ValueError, match="'random' is now 'per-step'"):
    Hadamard(16, "random")
  for policy in ("none", "fixed", "per-layer", "per-step"):
    assert Hadamard(16, policy).signs == policy
  with pytest.raises(ValueError, match="seed"):
    Hadamard(16, "fixed", seed=1.5)
  with pytest.raises(ValueError, match="compute_dtype"):
    Recipe("x", compute_dtype="float16")
  with pytest.raises(ValueError, match="backend"):
    Recipe("x", backend="cuda")
  with pytest.raises(ValueError, match=r"plain_route 'f32' not in \('lax', 'float32_output'\)"):
    Recipe("x", plain_route="f32")


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
  assert r.dgrad.lhs.scale_mode == "rceil" and r.dgrad.rhs.scale_mode == "even"
  assert r.fprop.rhs is None and r.fprop.lhs == AMD
  assert r.name.startswith("mxfp4-dh16[") and "wgrad.hadamard.block=32" in r.name
  assert recipes.from_config(r.to_config()) == r
  cfg = recipes.config_template("mxfp4")
  cfg.wgrad.hadamard.block = 0  # no-op removal on a recipe without rotation
  cfg.fprop.hadamard.signs = "fixed"
  r = recipes.from_config(cfg)
  assert r.fprop.hadamard == Hadamard(16, "fixed") and r.wgrad.hadamard is None


def test_plain_route_is_a_config_key():
  cfg = recipes.config_template("bf16")
  assert recipes.from_config(cfg).plain_route == "lax"
  cfg.plain_route = "float32_output"
  r = recipes.from_config(cfg)
  assert r.plain_route == "float32_output" and r.name == "bf16[plain_route=float32_output]"
  assert recipes.from_config(r.to_config()) == r


def test_sr_bits_and_round_up_scale_are_config_keys():
  """The few-bit and the biased SR from the config and back; defaults unchanged."""
  assert recipes.from_config(recipes.config_template("mxfp4-sr")) == recipes.recipe("mxfp4-sr")
  cfg = recipes.config_template("mxfp4-dh16")
  for op in ("lhs", "rhs"):
    cfg.wgrad[op].rounding = "stochastic"
    cfg.wgrad[op].sr_round_up_scale = 0.5
  cfg.wgrad.rhs.sr_bits = 8
  r = recipes.from_config(cfg)
  assert (r.wgrad.lhs.sr_bits, r.wgrad.lhs.sr_round_up_scale) == (24, 0.5)
  assert (r.wgrad.rhs.sr_bits, r.wgrad.rhs.sr_round_up_scale) == (8, 0.5)
  assert r.fprop == recipes.recipe("mxfp4-dh16").fprop
  assert "wgrad.rhs.sr_bits=8" in r.name and "wgrad.lhs.sr_round_up_scale=0.5" in r.name
  assert recipes.from_config(r.to_config()) == r


@pytest.mark.parametrize("field,value,message", [
    ("sr_bits", 32, r"sr_bits must be an int in \[1, 24\], got 32"),
    ("sr_bits", 0, r"sr_bits must be an int in \[1, 24\], got 0"),
    ("sr_round_up_scale", 1.5, r"sr_round_up_scale must be a number in \[0, 1\], got 1.5"),
    ("sr_round_up_scale", -0.1, r"must be a number in \[0, 1\], got -0.1"),
])
def test_bad_sr_values_name_what_is_allowed(field, value, message):
  cfg = recipes.config_template("mxfp4-sr")
  cfg.wgrad.lhs[field] = value
  with pytest.raises(ValueError, match=message):
    recipes.from_config(cfg)


def test_sr_keys_on_a_nearest_rounding_are_refused():
  cfg = recipes.config_template("mxfp4-dh16")
  cfg.wgrad.lhs.sr_bits = 8
  with pytest.raises(ValueError, match=r"sr_bits=8, sr_round_up_scale=1.0 set how a random "
                     r"rounding rounds; rounding='nearest' is not random"):
    recipes.from_config(cfg)


def test_recipe_wide_scale_mode():
  """quant.scale_mode sets every MX operand of every role; per-operand values win."""
  cfg = recipes.config_template("mxfp4-dh16")
  cfg.scale_mode = "floor"
  r = recipes.from_config(cfg)
  assert r.name == "mxfp4-dh16[scale_mode=floor]"
  assert dataclasses.replace(r, name="mxfp4-dh16-floor") == recipes.recipe("mxfp4-dh16-floor")
  assert recipes.from_config(r.to_config()) == r
  assert recipes.from_config(recipes.config_template(r.name)) == recipes.recipe("mxfp4-dh16")
  cfg.wgrad.rhs.scale_mode = "rceil"
  r = recipes.from_config(cfg)
  assert r.wgrad.rhs.scale_mode == "rceil" and r.wgrad.lhs.scale_mode == "floor"
  assert {getattr(r, role).lhs.scale_mode for role in recipes.ROLES} == {"floor"}
  assert "wgrad.rhs.scale_mode=rceil" in r.name and "fprop.lhs.scale_mode=floor" in r.name
  assert recipes.from_config(r.to_config()) == r
  # Only the MX operands move: fp8 operands keep theirs (a non-floor rule would raise).
  cfg = recipes.config_template("mxfp4-fprop")
  cfg.scale_mode = "floor"
  r = recipes.from_config(cfg)
  assert r.fprop == Gemm(QuantSpec("mxfp4"), QuantSpec("mxfp4"))
  assert r.dgrad == recipes.recipe("fp8").dgrad and r.wgrad == recipes.recipe("fp8").wgrad
  assert r.name == "mxfp4-fprop[scale_mode=floor]"
  cfg = recipes.config_template("nvfp4")
  cfg.scale_mode = "floor"
  with pytest.raises(ValueError, match="scale_mode='floor'.*'nvfp4' has none"):
    recipes.from_config(cfg)
  cfg = recipes.config_template("mxfp4")
  cfg.scale_mode = "round"
  with pytest.raises(ValueError, match="scale_mode 'round'"):
    recipes.from_config(cfg)
  cfg.scale_mode = "even"  # already the preset's rule: nothing changes
  assert recipes.from_config(cfg) == recipes.recipe("mxfp4")


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
  r = recipes.from_config(_parse(["prog", "--config.quant.name=mxfp4",
                                  "--config.quant.scale_mode=floor"]))
  assert r.name == "mxfp4[scale_mode=floor]"
  assert dataclasses.replace(r, name="mxfp4-floor") == recipes.recipe("mxfp4-floor")
  with pytest.raises(flags.IllegalFlagValueError):
    _parse(["prog", "--config.quant.wgrad.hadamard.block=abc"])
  r = recipes.from_config(_parse(
      ["prog", "--config.quant.name=mxfp4-dh16", "--config.quant.wgrad.rhs.rounding=stochastic",
       "--config.quant.wgrad.rhs.sr_round_up_scale=0.5", "--config.quant.wgrad.rhs.sr_bits=8"]))
  assert (r.wgrad.rhs.sr_bits, r.wgrad.rhs.sr_round_up_scale) == (8, 0.5)
