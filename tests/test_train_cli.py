"""train.py: the `--config.quant=NAME` shorthand and start-up errors."""

import os
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import pytest

from fp4jax.train.cli import expand_quant_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quant_shorthand_is_rewritten_to_quant_name():
  argv = ["train.py", "--config=c.py", "--config.quant=mxfp4", "--config.quant",
          "fp8", "--config.quant.wgrad.hadamard.block=32", "--config.steps=3",
          "--config.quantity=1"]
  assert expand_quant_flag(argv) == [
      "train.py", "--config=c.py", "--config.quant.name=mxfp4",
      "--config.quant.name", "fp8", "--config.quant.wgrad.hadamard.block=32",
      "--config.steps=3", "--config.quantity=1"]


def test_rewritten_argv_parses_into_the_default_config():
  argv = expand_quant_flag(["train.py", f"--config={ROOT}/configs/default.py",
                  "--config.quant=bf16", "--config.steps=7",
                  "--config.model.n_layers=2"])
  flag_values = flags.FlagValues()
  config_flag = config_flags.DEFINE_config_file(
      "config", flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  config = config_flag.value
  assert config.quant.name == "bf16"
  assert config.steps == 7 and config.model.n_layers == 2
  assert config.model.name == "tiny"


@pytest.mark.slow
def test_cli_rejects_an_unknown_recipe_before_training(tmp_path):
  result = subprocess.run(
      [sys.executable, "train.py", "--config=configs/default.py",
       f"--workdir={tmp_path}", "--config.quant=mxfp5"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "unknown recipe 'mxfp5'" in result.stderr
  assert "Traceback" not in result.stderr
  assert not os.listdir(tmp_path)
