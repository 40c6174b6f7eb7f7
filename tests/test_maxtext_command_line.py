"""The MaxText entry point's own checks of its command line, which run
before MaxText loads (so they need no MaxText): each mistake one line, exit 2."""

import pytest

from fp4jax import recipes
from fp4jax.maxtext import pretrain as maxtext_pretrain

RECIPE = "fp4jax_recipe=mxfp4-dh16"


def _line(capsys, *args):
  """(exit status, the one line on stderr) of the entry point with `args`."""
  status = maxtext_pretrain.main(["fp4jax.maxtext.pretrain", *args])
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  return status, lines[0]


def test_a_missing_config_file_and_an_unknown_key_are_one_line(tmp_path, capsys):
  status, line = _line(capsys, str(tmp_path / "nope.yml"), RECIPE)
  assert status == 2 and "nope.yml' does not exist" in line, line
  (tmp_path / "base.yml").write_text("learning_rate: 0.1\nsteps: 10\n")
  (tmp_path / "tiny.yml").write_text("base_config: base.yml\nrun_name: t\n")
  status, line = _line(capsys, str(tmp_path / "tiny.yml"), "learnin_rate=1e-3", RECIPE)
  assert status == 2 and "unknown MaxText config key 'learnin_rate'" in line, line
  assert "did you mean 'learning_rate'" in line and len(line) < 300, line


def test_the_recipes_offered_are_the_ones_maxtext_can_run(capsys):
  status, line = _line(capsys, "base.yml", "fp4jax_recipe=mxfp4-nope")
  assert status == 2 and "unknown recipe 'mxfp4-nope'; recipes MaxText can run:" in line
  offered = line.split("can run: ")[1].split(", ")
  assert "mxfp4-dh16" in offered
  for name in recipes.recipe_names():
    recipe = recipes.recipe(name)
    assert (name in offered) == (not (recipe.is_random or recipe.needs_layer_key)), name
