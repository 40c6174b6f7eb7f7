"""A two-recipe, few-step ablation end to end, and the report on hand-made runs."""

import importlib.util
import json
import os

import numpy as np
import pytest

from fp4jax.experiments import ablation
from fp4jax.experiments import declaration
from fp4jax.experiments import report
from tests.helpers import fake_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_ablation_config():
  spec = importlib.util.spec_from_file_location(
      "ablation_tiny", os.path.join(ROOT, "configs", "ablation_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.model.n_layers = 1
  config.steps = 4
  config.batch_size = 8
  config.seq_len = 32
  config.warmup_steps = 1
  config.eval_every = 2
  config.eval_batches = 2
  config.eval_batch_size = 8
  config.checkpoint_every = 100
  config.async_checkpointing = False
  config.ablation.recipes = "bf16,fp8"
  config.ablation.seeds = 2
  config.ablation.recipe_seeds = "bf16:1"
  config.ablation.compilation_cache = ""  # process-wide JAX state: not from a test
  config.ablation.cpus_per_run = 0  # in this process (test_parallel_runs: side by side)
  config.diagnostics.layers = "block_0/mlp/down"
  config.diagnostics.every = 3
  config.diagnostics.window = 2
  return config


def _declare(path):
  """A declaration with one claim whose recipe does not run (its verdict: not run)."""
  path.write_text(json.dumps({
      "study": "test", "baseline": "fp8", "primary": "late_mean", "late_from": 0.5,
      "smallest_effect_tokens": 0.05, "alpha": 0.05, "correction": "holm", "power": 0.8,
      "claims": [{"text": "Wgrad costs", "contrasts": [
          {"label": "mxfp4 - fp8", "weights": {"mxfp4": 1, "fp8": -1}, "direction": ">"}]}]}))
  return str(path)


@pytest.mark.slow
def test_two_recipe_ablation_end_to_end_and_resumable(tmp_path, capsys):
  config = _tiny_ablation_config()
  config.ablation.declaration = _declare(tmp_path / "DECLARATION.json")
  rows = ablation.run_ablation(config, str(tmp_path))
  record = json.loads((tmp_path / "declaration_record.json").read_text())
  assert record["sha256"] == declaration.file_hash(config.ablation.declaration)
  assert [r.recipe for r in rows] == ["bf16", "fp8"]
  assert [r.n for r in rows] == [1, 2]  # recipe_seeds: bf16 runs the first seed only
  assert not (tmp_path / "bf16_seed1").exists()
  for name in ("table.md", "curves.png", "diagnostics.png", "snr.png",
               "bf16_seed0/diagnostics.png", "fp8_seed0/diagnostics.png",
               "fp8_seed1/wall.json", "ablation_config.json"):
    assert (tmp_path / name).is_file(), name
  # The target is fp8's own loss at 75% of its tokens, so fp8 has zero overhead.
  assert rows[1].reached == 2 and rows[1].overhead == 0.0
  table = (tmp_path / "table.md").read_text()
  assert "| bf16 |" in table and "| fp8 |" in table and "baseline" in table
  assert "| bf16 | 1 | " in table  # one pair against fp8 in the paired estimates
  assert "Declared before the first run" in table and "- **not run**: Wgrad" in table
  assert "Instruments on the training batch" in table and "| fp8 | " in table
  metrics = [json.loads(l) for l in
             (tmp_path / "fp8_seed0" / "metrics.jsonl").read_text().split("\n") if l]
  evals = [r for r in metrics if "eval_loss" in r]
  assert all(len(r["eval_batch_losses"]) == 2 and r["eval_loss_se"] > 0 for r in evals)
  assert evals[-1]["eval_loss"] == pytest.approx(np.mean(evals[-1]["eval_batch_losses"]))
  diag = {k for row in metrics for k in row if k.startswith("diag/")}
  assert "diag/train/block_0/mlp/down/fprop/out_err" not in diag  # wgrad only on train
  measured = lambda key: {r["step"] for r in metrics if key in r}
  assert measured("diag/ref/block_0/mlp/down/fprop/out_err") == {1, 3, 4}  # step % 3 < 2
  assert measured("diag/train/block_0/mlp/down/wgrad/bias") == {4}
  assert measured("diag/ref/block_0/mlp/down/dgrad/step_cos") == {4}
  assert measured("diag/train/block_0/mlp/down/dgrad/snr") == {1, 3, 4}
  assert measured("diag/train/block_0/mlp/down/wgrad/snr_true") == {1, 3, 4}  # batch of 8
  assert measured("diag/train/block_0/mlp/down/fprop/out_signed") == {1, 3, 4}
  assert json.loads((tmp_path / "fp8_seed1" / "config.json").read_text())["seed"] == (
      config.seed + 1)

  capsys.readouterr()
  before = (tmp_path / "fp8_seed1" / "metrics.jsonl").read_text()
  ablation.run_ablation(config, str(tmp_path))
  assert capsys.readouterr().out.count("already completed, skipped") == 3
  assert (tmp_path / "fp8_seed1" / "metrics.jsonl").read_text() == before


def test_recipe_seeds():
  config = _tiny_ablation_config()
  config.ablation.recipes, config.ablation.seeds = "bf16,fp8,mxfp4", 5
  config.ablation.recipe_seeds = " bf16:2, mxfp4:9"
  names = [a.name for a in ablation.arm_list(config)]
  assert ablation.seed_counts(config, names) == {"bf16": 2, "fp8": 5, "mxfp4": 5}
  config.ablation.recipe_seeds = "bf16:2,mxfp8:1"  # mxfp8 is not in this ablation
  assert ablation.seed_counts(config, names)["bf16"] == 2
  for bad in ("bf16", "mxfp5:2", "bf16:x", "bf16:0"):
    config.ablation.recipe_seeds = bad
    with pytest.raises(ValueError, match="recipe_seeds|>= 1 seed|unknown recipe"):
      ablation.seed_counts(config, names)


def test_bad_recipe_or_missing_baseline_fails_at_start():
  config = _tiny_ablation_config()
  config.ablation.recipes = "fp8,mxfp5"
  with pytest.raises(ValueError, match="unknown recipe"):
    [a.name for a in ablation.arm_list(config)]
  config.ablation.recipes = "bf16,mxfp4"
  with pytest.raises(ValueError, match="baseline"):
    [a.name for a in ablation.arm_list(config)]


def test_report_on_synthetic_runs(tmp_path):
  workdir = str(tmp_path)
  fake_run(workdir, "fp8_seed0", [5.0, 4.0, 3.0, 2.0])
  fake_run(workdir, "fp8_seed1", [5.0, 4.0, 3.0, 2.0])
  fake_run(workdir, "mxfp4_seed0", [5.0, 4.5, 3.5, 2.5, 1.5])
  fake_run(workdir, "mxfp4_seed1", [5.0, 4.0, 3.0, 2.5, 2.0])
  fake_run(workdir, "mxfp4-sr_seed0", [5.0, 4.5, float("nan")])
  fake_run(workdir, "mxfp4-sr_seed1", [5.0, 4.5, 4.2], status="diverged")
  rows = report.write_report(workdir, ["fp8", "mxfp4", "mxfp4-sr"])
  by = {r.recipe: r for r in rows}
  assert by["fp8"].tokens == 300.0 and by["fp8"].n == 2
  # mxfp4 reaches loss 2.0 at 350 (interpolated) and at 400 tokens.
  assert by["mxfp4"].tokens == pytest.approx(375.0)  # the median over the seeds
  assert by["mxfp4"].overhead == pytest.approx(0.25)
  assert by["mxfp4"].delta_loss[0] == pytest.approx(-0.25)  # paired by seed: -0.5 and 0
  assert by["mxfp4-sr"].diverged == 2 and by["mxfp4-sr"].tokens is None
  table = (tmp_path / "table.md").read_text()
  assert "| +25.0% |" in table and "not reached" in table
  assert (tmp_path / "curves.png").stat().st_size < 300_000
  # Target at half of fp8's tokens: loss 3.5 (at 150 tokens); mxfp4 reaches it at 200 and 150.
  runs = report.load_runs(workdir, ["fp8", "mxfp4"])
  rows, targets, _ = report.summarize(runs, "fp8", target_at=0.5)
  assert targets == {0: pytest.approx(3.5), 1: pytest.approx(3.5)}
  assert rows[1].tokens == pytest.approx(175.0)


def test_runs_are_compared_with_the_same_seeds_baseline(tmp_path):
  """Each seed has its own target and baseline tokens: a recipe 25% slower
  than fp8 on every seed shows +25% with no spread, whatever the seeds do."""
  workdir = str(tmp_path)
  fake_run(workdir, "fp8_seed0", [5.0, 4.0, 3.0, 2.0], tokens_per_eval=100)
  fake_run(workdir, "fp8_seed1", [6.0, 5.0, 4.0, 3.0], tokens_per_eval=100)
  fake_run(workdir, "mxfp4_seed0", [5.0, 4.0, 3.0, 2.0], tokens_per_eval=125)
  fake_run(workdir, "mxfp4_seed1", [6.0, 5.0, 4.0, 3.0], tokens_per_eval=125)
  rows, targets, _ = report.summarize(report.load_runs(workdir), "fp8")
  assert targets == {0: 2.0, 1: 3.0}
  mxfp4 = {r.recipe: r for r in rows}["mxfp4"]
  assert mxfp4.overhead == pytest.approx(0.25)
  assert mxfp4.delta_loss == (0.0, 0.0)


@pytest.mark.parametrize("fp8, mxfp4", [
    ([5.0, 4.0], [5.5]),  # the recipe's one evaluation is at 0 tokens: no token ratio
    ([5.5], [5.0, 4.0]),  # the baseline's: it was at the target before its first token
    ([5.0, 4.0], []),     # a training row, no evaluation yet
], ids=["recipe", "baseline", "no-evaluation"])
def test_the_report_on_runs_of_one_row(tmp_path, fp8, mxfp4, capsys):
  workdir = str(tmp_path)
  fake_run(workdir, "fp8_seed0", fp8)
  fake_run(workdir, "mxfp4_seed0", mxfp4)
  if not mxfp4:
    (tmp_path / "mxfp4_seed0" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "tokens": 100, "loss": 5.0}) + "\n")
  assert report.main(["report", workdir]) == 0, capsys.readouterr().err
  assert "| mxfp4 |" in (tmp_path / "table.md").read_text()


def test_runs_with_diagnostics_stay_unscanned_on_gpus(monkeypatch):
  """The trainer scans on GPUs when model.scan_layers is unset; diagnostics
  read per-block paths, so the ablation's runs with diagnostics are unscanned."""
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  from fp4jax.train import config as train_config  # pylint: disable=g-import-not-at-top
  config = train_config.base_config()
  config.ablation = ablation.ablation_config()
  config.diagnostics = ablation.diagnostics_config()
  tokenizer = tokenizers.make_tokenizer(config.data.tokenizer)
  scanned = lambda c: train_config.resolve(c, tokenizer)[0].scan_layers
  assert ablation.run_config(config, "fp8", 0).model.scan_layers is None  # the CPU: as given
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not scanned(ablation.run_config(config, "fp8", 0))
  config.diagnostics.enabled = False
  assert scanned(ablation.run_config(config, "fp8", 0))
