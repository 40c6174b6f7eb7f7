"""Every config file in configs/ loads (its imports and its parent configs resolve)."""

import glob
import os

import pytest

from fp4jax.train import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def test_the_configs_folder_is_found():
  assert len(CONFIGS) >= 5, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_a_config_file_loads_with_steps_and_a_recipe(path):
  config = cli.load_config_file(path + (":1e-2" if path.endswith("stress_tiny.py") else ""))
  assert config.steps >= 1
  assert config.quant.name
