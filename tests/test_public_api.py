"""`import fp4jax`: dir() lists the public names, each resolves, and nothing loads early."""

import subprocess
import sys

import fp4jax


def test_dir_lists_every_public_name_and_each_resolves():
  listed = dir(fp4jax)
  assert set(fp4jax.__all__) <= set(listed), set(fp4jax.__all__) - set(listed)
  assert "__version__" in listed and listed == sorted(listed)
  assert "importlib" not in listed and "_EXPORTS" not in listed
  for name in fp4jax.__all__:
    assert getattr(fp4jax, name) is not None, name
  assert fp4jax.flax.__name__ == "fp4jax.flax"
  assert fp4jax.quantize.__module__ == "fp4jax.numerics.formats"
  assert "numerics" in dir(fp4jax)  # a submodule, once imported


def test_dir_imports_nothing_and_completion_finds_the_api():
  """dir() names the API without importing a submodule, jax or Flax; the
  standard library's completer (which, as IPython's, asks dir()) completes
  `fp4jax.quant` and `fp4jax.rec`."""
  code = ("import rlcompleter, sys, fp4jax\n"
          "print(sorted(set(dir(fp4jax)) & set(fp4jax.__all__)) == sorted(fp4jax.__all__))\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fp4jax', 'jax', 'flax')))\n"
          "complete = rlcompleter.Completer({'fp4jax': fp4jax}).attr_matches\n"
          "print(sorted(complete('fp4jax.quant') + complete('fp4jax.rec')))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.splitlines()
  assert out[:2] == ["True", "['fp4jax']"], out
  assert out[2] == "['fp4jax.quantize(', 'fp4jax.recipe(', 'fp4jax.recipe_names()']", out
