"""MaxText's own training loop with an fp4jax recipe in place:

  python -m fp4jax.maxtext.pretrain <MaxText config.yml> [key=value ...] fp4jax_recipe=NAME

Every argument but `fp4jax_recipe` goes to MaxText's trainer
(maxtext.trainers.pre_train.train) as it is. The recipe enters through
MaxText's `configure_quantization`, replaced in memory (MaxText's files are
not touched) by one that returns fp4jax.maxtext.quantization's object. Bad
input (an unknown or random recipe, MaxText's own `quantization` set too,
per-device tokens that 32 does not divide, MaxText not installed, a missing
config file, a key that its config files do not have, a value MaxText
refuses) is one line on stderr and exit status 2.
"""

import os
import sys

from fp4jax import errors
from fp4jax.maxtext import supported_recipes

PROG = "fp4jax.maxtext.pretrain"
FLAG = "fp4jax_recipe="


def split_recipe(argv):
  """(recipe name, the other arguments) of a command line (without argv[0])."""
  names = [a[len(FLAG):] for a in argv if a.startswith(FLAG)]
  if len(names) != 1:
    raise errors.UserError(f"give {FLAG}NAME once (got {len(names)}); usage: python -m "
                           f"{PROG} <MaxText config.yml> [key=value ...] {FLAG}NAME")
  return names[0], [a for a in argv if not a.startswith(FLAG)]


def check_command_line(rest):
  """UserError (one line) for a MaxText config file that is missing, or a
  key=value whose key none of its config files (the file, the base_config it
  names, ...) has; MaxText's own message lists every key there is."""
  if not rest or not os.path.isfile(rest[0]):
    given = repr(rest[0]) if rest else "none"
    raise errors.UserError(f"the MaxText config file {given} does not exist; give the "
                           "path of a .yml, e.g. MaxText's configs/base.yml, first")
  try:
    import yaml  # pylint: disable=g-import-not-at-top
  except ImportError:
    return  # MaxText (which needs PyYAML) says it
  keys, path = set(), rest[0]
  while path and os.path.isfile(path) and len(keys) < 100_000:
    with open(path, encoding="utf-8") as f:
      loaded = yaml.safe_load(f) or {}
    if not isinstance(loaded, dict):
      raise errors.UserError(f"the MaxText config file {path!r} is not a mapping of keys")
    keys |= set(loaded)
    base = loaded.get("base_config")
    path = base and os.path.join(os.path.dirname(path), str(base))
  for arg in rest[1:]:
    key = arg.split("=", 1)[0]
    if "=" in arg and key not in keys:
      raise errors.UserError(f"unknown MaxText config key {key!r} (not in {rest[0]} or the "
                             f"files it builds on){errors.did_you_mean(key, keys)}")


def _maxtext_config(args):
  """MaxText's config of the command line; its refusal of a value as one line."""
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  try:
    return pyconfig.initialize(args)
  except Exception as e:  # pylint: disable=broad-except
    # MaxText raises ValueError, TypeError, pydantic errors... with long texts.
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise errors.UserError(f"MaxText refused the command line: {type(e).__name__}: "
                           f"{first}") from None


def _dtype_name(dtype):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return jnp.dtype(dtype).name


def quantization_for(name, config):
  """The Fp4jaxQuantization of recipe `name` for a MaxText config (UserError if it cannot take it)."""
  from fp4jax.maxtext.quantization import Fp4jaxQuantization  # pylint: disable=g-import-not-at-top
  if config.quantization:
    raise errors.UserError(f"{FLAG}{name} replaces MaxText's quantization; drop "
                           f"quantization={config.quantization!r}")
  tokens = config.per_device_batch_size * config.max_target_length
  if tokens % supported_recipes.BLOCK_SIZE:
    raise errors.UserError(
        f"per-device tokens per_device_batch_size x max_target_length = "
        f"{config.per_device_batch_size} x {config.max_target_length} = {tokens:g} must be "
        f"a multiple of {supported_recipes.BLOCK_SIZE} (Wgrad's MX blocks run along the tokens)")
  return Fp4jaxQuantization(recipe=_recipe(name, _dtype_name(config.dtype)))


def _recipe(name, dtype):
  try:
    return supported_recipes.recipe_for(name, dtype)
  except ValueError as e:
    raise errors.UserError(str(e)) from None


def install(name):
  """Makes MaxText's configure_quantization return recipe `name`'s object."""
  from maxtext.layers import quantizations  # pylint: disable=g-import-not-at-top

  announced = []

  def configure_quantization(config, quant_mode_str="train"):
    del quant_mode_str
    quant = quantization_for(name, config)
    if not announced:
      print(f"fp4jax.maxtext: MaxText's projections run recipe {name}", flush=True)
      announced.append(True)
    return quant

  quantizations.configure_quantization = configure_quantization


def main(argv=None):
  argv = sys.argv if argv is None else argv
  try:
    name, rest = split_recipe(argv[1:])
    _recipe(name, "bfloat16")  # an unknown or random name fails before MaxText loads
    check_command_line(rest)
    try:
      from absl import app  # pylint: disable=g-import-not-at-top
      from maxtext.trainers.pre_train import train  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise errors.UserError(f"MaxText is not installed ({e}); pip install -e \".[maxtext]\" "
                             "(Python >= 3.12)") from None
    install(name)
    _maxtext_config([argv[0]] + rest)  # a bad value: one line, before training
  except errors.UserError as e:
    return errors.report(PROG, e)

  def run(args):
    try:
      train.main(args)
    except errors.UserError as e:
      sys.exit(errors.report(PROG, e))

  app.run(run, argv=[argv[0]] + rest)
  return 0


if __name__ == "__main__":
  sys.exit(main())
