"""The resume check compares what a config resolves to, and shows it.

A workdir's checkpoint carries the resolved config of its run; a resume
with an override that names the value already in effect is the same run,
and a real change is shown with the values in effect, never a preset's None
placeholder.
"""

import json

import pytest

from fp4jax import errors
from fp4jax import recipes
from fp4jax.train import config as train_config
from fp4jax.train import workdir as workdir_lib
from tests.helpers import tiny_config


def _resolved(config):
  recipe = train_config.resolve_recipe(config.quant, config.dtype)
  return dict(model=dict(n_layers=1), recipe=recipe.to_config().to_dict())


def _workdir_of(tmp_path, config):
  """A workdir whose checkpoint (step 4) carries `config`'s resolved config."""
  workdir = tmp_path / config.quant.name
  (workdir / "checkpoints" / "4" / "state").mkdir(parents=True)
  (workdir / "checkpoints" / "4" / "data").mkdir()
  saved = dict(json.loads(config.to_json()), resolved=_resolved(config))
  (workdir / "checkpoints" / "4" / "data" / "metadata").write_text(
      json.dumps({"processes": [], "config": saved}))
  return str(workdir)


def _set(config, key, value):
  node = config
  *path, leaf = key.split(".")
  for name in path:
    node = node[name]
  node[leaf] = value


def _no_op_overrides(name, dtype):
  """{quant key: the value in effect} for every placeholder of preset `name`
  that resolves to a value, and quant.scale_mode where one rule covers it."""
  template = recipes.config_template(name)
  recipe = train_config.resolve_recipe(template, dtype)
  effect = workdir_lib.flat(recipe.to_config().to_dict())
  out = {k: effect[k] for k, v in workdir_lib.flat(template.to_dict()).items()
         if v is None and effect.get(k) is not None}
  rules = {spec.scale_mode for spec in recipes._mx_specs(recipe)}  # pylint: disable=protected-access
  return out, (rules.pop() if len(rules) == 1 else None)


@pytest.mark.parametrize("name", recipes.recipe_names())
def test_a_no_op_override_on_every_preset_is_the_same_run(tmp_path, name):
  config = tiny_config(**{"quant.name": name})
  workdir = _workdir_of(tmp_path, config)
  overrides, rule = _no_op_overrides(name, config.dtype)
  cases = [overrides] + ([{"scale_mode": rule}] if rule else [])
  for given in cases:
    again = tiny_config(**{"quant.name": name})
    for key, value in given.items():
      _set(again.quant, key, value)
    assert workdir_lib.check_resume_config(workdir, again, _resolved(again)) == [], given


def test_a_real_change_shows_the_values_in_effect(tmp_path):
  config = tiny_config(**{"quant.name": "mxfp4-dh16"})
  workdir = _workdir_of(tmp_path, config)
  config.quant.scale_mode = "floor"
  with pytest.raises(errors.UserError, match=r"quant.name: 'mxfp4-dh16' -> "
                     r"'mxfp4-dh16\[scale_mode=floor\]', quant.dgrad.lhs.scale_mode: "
                     r"'even' -> 'floor'") as raised:
    workdir_lib.check_resume_config(workdir, config, _resolved(config))
  assert "None" not in str(raised.value)
