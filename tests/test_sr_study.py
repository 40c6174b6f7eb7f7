"""E3 (configs/sr_bias_tiny.py): its arms are the declared recipes, its
declaration loads with the sizes the config runs, and the sizing that chose
them reproduces E1's published MDEs."""

import dataclasses
import importlib.util
import json
import os

import pytest

from fp4jax import errors, recipes
from fp4jax.experiments import ablation, arms, declaration, report, sizing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECLARATION = os.path.join(ROOT, "results", "sr_bias_tiny", "DECLARATION.json")


def _config():
  spec = importlib.util.spec_from_file_location("sr_bias_tiny",
                                                os.path.join(ROOT, "configs", "sr_bias_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_the_arms_change_only_wgrad_as_declared():
  config = _config()
  by_name = {a.name: a.recipe for a in ablation.arm_list(config)}
  dh16 = recipes.recipe("mxfp4-dh16")
  assert by_name["R0"] == dh16
  for name, recipe in by_name.items():
    assert (recipe.fprop, recipe.dgrad) == (dh16.fprop, dh16.dgrad), name
  sr = recipes.recipe("mxfp4-sr").wgrad
  s1, s2, s3 = (by_name[n].wgrad for n in ("S1", "S2", "S3"))
  assert (s1.lhs, s1.rhs, s1.hadamard) == (sr.lhs, sr.rhs, dh16.wgrad.hadamard)
  for op in ("lhs", "rhs"):
    assert getattr(s2, op) == dataclasses.replace(getattr(s1, op), sr_round_up_scale=0.5)
    assert getattr(s3, op) == dataclasses.replace(getattr(s1, op), sr_bits=8)
  assert by_name["P1"].wgrad == recipes.recipe("mxfp4-rh16").wgrad
  assert by_name["P2"].wgrad == recipes.recipe("mxfp4-lh16").wgrad
  raw = json.load(open(DECLARATION))
  assert ablation.seed_counts(config, list(by_name)) == raw["design"]["seeds"]
  assert config.ablation.declaration == "results/sr_bias_tiny/DECLARATION.json"


@pytest.mark.parametrize("override, match", [
    ("wgrad.lhs.sr_round_up_scale=half", "'half' is not a number"),
    ("wgrad.lhs.sr_round_up_scale=2", r"sr_round_up_scale must be a number in \[0, 1\], got 2.0"),
    ("wgrad.lhs.sr_bits=8", "rounding='nearest' is not random"),
])
def test_bad_sr_arms_name_what_was_given(override, match):
  with pytest.raises(errors.UserError, match=match):
    arms.parse_arm(f"S9=mxfp4-dh16:{override}")


def test_the_declaration_loads_and_names_only_its_arms():
  decl = declaration.load(DECLARATION)
  arms = {a.name for a in ablation.arm_list(_config())}
  assert decl.baseline == "R0" and len(decl.claims) == 4
  for claim in decl.claims:
    for contrast in claim.contrasts:
      assert set(contrast.weights) <= arms, contrast.label


def test_sizing_reproduces_e1s_published_mdes():
  """E1's table.md: MDE at 80% power 0.0344 (C1) and 0.0508 (C2) nats with
  3 seeds at Holm's 98.33% level, smallest effect 0.0063; C1 needs 13 seeds."""
  runs = report.load_runs(os.path.join(ROOT, "results", "horizon_tiny"))
  out = sizing.size(runs, {"C1": ("A1", "A2"), "C2": ("A3", "A0")}, "A0", claims=3,
                    max_seeds=20)
  assert out["smallest_effect_nats"] == pytest.approx(0.0063, abs=5e-5)
  assert out["contrasts"]["C1"]["mde_by_seeds"][3] == pytest.approx(0.0344, abs=5e-5)
  assert out["contrasts"]["C2"]["mde_by_seeds"][3] == pytest.approx(0.0508, abs=5e-5)
  assert out["contrasts"]["C1"]["seeds_needed"] == 13
  assert sizing.seeds_needed(0.01, 0.0, 0.05, max_seeds=5) is None
