"""Every config file in configs/ loads (its imports and its parent configs resolve)."""

import glob
import os

import jax
import pytest

from fp4jax.train import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def test_the_configs_folder_is_found():
  assert len(CONFIGS) >= 5, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_a_config_file_loads_with_steps_and_a_recipe(path):
  args = {"stress_tiny.py": ":1e-2", "stage_widths.py": ":64,lr=0.003"}
  config = cli.load_config_file(path + args.get(os.path.basename(path), ""))
  assert config.steps >= 1
  assert config.quant.name


def test_blocks_are_scanned_by_default_on_gpus_where_no_block_needs_its_own_path(monkeypatch):
  """model.scan_layers unset: scanned on GPUs (the fast compile), not on the CPU, and
  never where bf16_layers or the per-block Wgrad switch name blocks."""
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  from fp4jax.train import config as train_config  # pylint: disable=g-import-not-at-top
  config = cli.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  tokenizer = tokenizers.make_tokenizer(config.data.tokenizer)
  scanned = lambda c: train_config.resolve(c, tokenizer)[0].scan_layers
  assert config.model.scan_layers is None and not scanned(config)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert scanned(config)
  config.model.bf16_layers = ("head",)
  assert scanned(config)
  config.model.bf16_layers = ("block_0",)
  assert not scanned(config)
  config.model.bf16_layers = ()
  config.adaptive_wgrad.enabled = True
  assert not scanned(config)
  config.adaptive_wgrad.enabled = False
  config.model.scan_layers = False
  assert not scanned(config)
  ablation = cli.load_config_file(os.path.join(ROOT, "configs", "ablation_gpu.py"))
  assert ablation.model.scan_layers is False  # its diagnostics read per-block paths


def test_the_8b_config_runs_fsdp_within_a_host_and_data_across_hosts():
  """configs/llama3_8b_c4.py's own mesh: FSDP over a host's 8 GPUs (pure data parallelism
  does not fit 8 H200s: docs/sharding.md), data parallelism across hosts, 2 sequences
  per GPU on 8."""
  from fp4jax import sharding  # pylint: disable=g-import-not-at-top
  config = cli.load_config_file(os.path.join(ROOT, "configs", "llama3_8b_c4.py"))
  assert sharding.mesh_shape(config.mesh, 8) == (1, 8, 1)
  assert sharding.mesh_shape(config.mesh, 16) == (2, 8, 1)
  assert config.micro_batch == 2 * 8 and config.batch_size % config.micro_batch == 0
