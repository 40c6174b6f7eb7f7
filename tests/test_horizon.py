"""The long-horizon study's pieces: arms, the constant schedule on resume, the
growth statistic, E2's outcomes, the declaration and the results kept in git."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fp4jax import errors
from fp4jax import recipes
from fp4jax.experiments import ablation
from fp4jax.experiments import arms
from fp4jax.experiments import committed
from fp4jax.experiments import declaration
from fp4jax.experiments import horizon
from fp4jax.experiments import report
from fp4jax.train import step as train_step
from fp4jax.train import trainer
from fp4jax.train.metrics_log import read_metrics
from tests.helpers import final_state, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_config(name, *args):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


# ------------------------------------------------------------------ arms

def test_the_arms_of_the_horizon_study_are_the_intended_recipes():
  config = _load_config("horizon_tiny")
  by_name = {a.name: a.recipe for a in ablation.arm_list(config)}
  assert list(by_name) == ["A0", "A1", "A2", "A3", "fp8"]
  dh16 = recipes.recipe("mxfp4-dh16")
  for name in ("A0", "A1", "A2", "A3"):  # only Wgrad changes
    assert (by_name[name].fprop, by_name[name].dgrad) == (dh16.fprop, dh16.dgrad)
  assert by_name["A0"] == dh16
  assert by_name["A1"].wgrad == recipes.recipe("mxfp4-rh16").wgrad   # per-step signs
  assert by_name["A2"].wgrad == recipes.recipe("mxfp4-lh16").wgrad   # per-layer signs
  sr = recipes.recipe("mxfp4-sr").wgrad
  assert (by_name["A3"].wgrad.lhs, by_name["A3"].wgrad.rhs) == (sr.lhs, sr.rhs)
  assert by_name["A3"].wgrad.hadamard == dh16.wgrad.hadamard
  assert by_name["A1"].name == "mxfp4-dh16[wgrad.hadamard.signs=per-step]"
  assert ablation.seed_counts(config, list(by_name)) == dict(A0=3, A1=3, A2=3, A3=3, fp8=1)
  stress = _load_config("stress_tiny", "3e-2")
  assert [a.name for a in ablation.arm_list(stress)] == ["A0", "A1", "A3", "fp8"]
  assert (stress.lr, stress.steps, stress.log_every, stress.min_lr_ratio) == (3e-2, 600, 1, 1.0)


def test_an_arm_on_top_of_the_configs_quant_and_in_the_run_config():
  arm = arms.parse_arm("A1=mxfp4-dh16:wgrad.hadamard.signs=per-step,wgrad.hadamard.block=32")
  assert arm.overrides == (("wgrad.hadamard.signs", "per-step"), ("wgrad.hadamard.block", 32))
  config = _load_config("horizon_tiny")
  config.quant.backend = "xla"  # set by the config: kept under the arm
  cfg = ablation.run_config(config, arm, 2)
  assert (cfg.seed, cfg.quant.name, cfg.quant.backend) == (2, "mxfp4-dh16", "xla")
  assert cfg.quant.wgrad.hadamard.block == 32 and "ablation" not in cfg
  assert arms.parse_arm("fp8") == arms.Arm("fp8", "fp8", "fp8")
  assert arms.parse_arm("X=mxfp4:wgrad.lhs.block_2d=true").recipe.wgrad.lhs.block_2d


@pytest.mark.parametrize("text, match", [
    ("A1=mxfp4-dh16:wgrad.hadamard.sign=per-step", r"'wgrad.hadamard.sign=per-step' is not KEY=VALUE"),
    ("A1=mxfp4-dh16:wgrad.hadamard.signs", "is not KEY=VALUE"),
    ("A1=mxfp4-dh16:name=fp8", "is not KEY=VALUE"),
    ("A1=mxfp4-dh16:wgrad.hadamard.signs=per-stp", "sign policy 'per-stp'"),
    ("A1=mxfp4-dh16:wgrad.hadamard.block=x", "'x' is not an integer"),
    ("A1=mxfp-dh16", "unknown preset 'mxfp-dh16' \\(did you mean 'mxfp4-dh16'"),
    ("A_1=fp8", "arm name 'A_1'"),
    ("A0=fp8; A0=bf16", r"\['A0'\] are given more than once"),
])
def test_bad_arms_are_refused_naming_what_was_given(text, match):
  with pytest.raises(errors.UserError, match=match):
    arms.parse_arms(text)


@pytest.mark.slow
def test_a_bad_arm_on_the_command_line_is_one_line_and_exit_2(tmp_path):
  bad = "A1=mxfp4-dh16:wgrad.hadamard.sign=per-step"
  out = subprocess.run(
      [sys.executable, "-m", "fp4jax.experiments.ablation", "--config=configs/horizon_tiny.py",
       f"--workdir={tmp_path}", f"--config.ablation.arms={bad}"],
      cwd=ROOT, capture_output=True, text=True, check=False, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2, out.stderr
  assert len(out.stderr.strip().splitlines()) == 1 and bad in out.stderr
  assert "ROLE.hadamard.{block, signs, seed}" in out.stderr
  assert not os.listdir(tmp_path)  # refused before anything was written


# ------------------------------------------------------ constant schedule

def test_a_constant_schedule_does_not_depend_on_steps_bitwise():
  def rates(steps, ratio):
    cfg = ml_collections.ConfigDict(dict(lr=3e-3, warmup_steps=30, steps=steps, min_lr_ratio=ratio))
    return np.asarray(jax.jit(jax.vmap(train_step.lr_schedule(cfg)))(jnp.arange(300)))
  assert np.array_equal(rates(300, 1.0), rates(2000, 1.0))
  assert np.all(rates(300, 1.0)[30:] == np.float32(3e-3))


@pytest.mark.slow
@pytest.mark.usefixtures("one_device")
def test_steps_raised_on_resume_take_the_same_first_steps_bitwise(tmp_path):
  config = lambda steps: tiny_config(steps=steps, min_lr_ratio=1.0, async_checkpointing=False,
                                     checkpoint_every=8)  # only at the end of each run
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  trainer.train(config(8), straight)
  trainer.train(config(5), resumed)
  assert trainer.train(config(8), resumed)["resumed_from_step"] == 5
  loss = lambda workdir: [(r["step"], r["loss"], r["lr"]) for r in read_metrics(workdir) if "loss" in r]
  assert loss(resumed) == loss(straight) and len(loss(straight)) == 8
  (_, a), (_, b) = final_state(straight), final_state(resumed)
  jax.tree.map(np.testing.assert_array_equal, a, b)


# ------------------------------------------------------------ statistics

def test_growth_recovers_a_known_slope_against_ln_step():
  rng = np.random.default_rng(0)
  steps = np.arange(0, 2001, 250, dtype=np.float64)
  diff = 0.01 + 0.004 * np.log(np.maximum(steps, 1)) + rng.normal(0, 1e-4, steps.size)
  assert horizon.growth(steps, diff, 250, 2000) == pytest.approx(0.004, abs=3e-4)
  exact = 0.02 - 0.003 * np.log(np.maximum(steps, 1))
  assert horizon.growth(steps, exact, 250, 2000) == pytest.approx(-0.003, rel=1e-9)
  # Step 0 (ln 0) and points outside [lo, hi] are not fitted.
  exact[0] = exact[-1] = exact[1] = 99.0
  assert horizon.growth(steps, exact, 500, 1750) == pytest.approx(-0.003, rel=1e-9)
  assert math.isnan(horizon.growth(steps, exact, 2000, 2000))  # one point


DECLARATION = dict(
    study="horizon_test", baseline="A0", primary="late_mean", late_from=0.5,
    smallest_effect_tokens=0.05, alpha=0.05, correction="holm", power=0.8,
    claims=[dict(text="C1", contrasts=[dict(label="C1 = A1 - A2", weights=dict(A1=1, A2=-1),
                                            direction=">")]),
            dict(text="C3", contrasts=[dict(label="C3 = A2 - A0", weights=dict(A2=1, A0=-1),
                                            direction="!=")])],
    growth=dict(from_step=250, to_step=2000),
    validity=[dict(claim="C1", arms=["A1", "A2"], tolerance=0.03, role="wgrad")])


def _write_run(folder, arm, seed, steps, losses, wgrad_err=None, snr_true=None,
               status="completed"):
  path = os.path.join(folder, f"{arm}_seed{seed}")
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step, loss in zip(steps, losses):
      row = dict(step=int(step), tokens=int(step) * 1024, eval_loss=float(loss))
      if wgrad_err is not None and step:
        row["diag/train/block_0/attn/q/wgrad/lhs_err"] = wgrad_err
        row["diag/train/block_0/attn/q/wgrad/rhs_err"] = 2 * wgrad_err
      if snr_true is not None and step:
        row["diag/train/block_0/attn/q/wgrad/snr_true"] = snr_true
      f.write(json.dumps(row) + "\n")
  with open(os.path.join(path, "summary.json"), "w") as f:
    json.dump(dict(status=status), f)


def test_the_growth_family_and_the_validity_rule_on_synthetic_curves(tmp_path):
  rng = np.random.default_rng(1)
  steps = np.arange(0, 2001, 250)
  ln = np.log(np.maximum(steps, 1))
  folder = str(tmp_path)
  for seed in range(3):
    base = 4.0 - 0.3 * ln + rng.normal(0, 0.01, steps.size)
    _write_run(folder, "A0", seed, steps, base)
    _write_run(folder, "A2", seed, steps, base + 0.001 * rng.normal(size=steps.size), 0.100)
    # A1's gap to A2 grows by 0.01 +- 0.001 nats per e-fold of steps.
    _write_run(folder, "A1", seed, steps, base + (0.01 + 0.001 * rng.normal()) * ln, 0.105)
  with open(tmp_path / "DECLARATION.json", "w") as f:
    json.dump(DECLARATION, f)
  declaration.record(folder, str(tmp_path / "DECLARATION.json"))
  assert horizon.main(["horizon", "e1", folder]) == 0
  text = (tmp_path / "horizon.md").read_text()
  assert "declaration declared" in text and (tmp_path / "contrasts.png").is_file()
  c1 = next(l for l in text.splitlines() if l.startswith("- **") and "C1 = A1 - A2" in l)
  assert c1.startswith("- **supported**: C1")
  assert float(re.search(r"C1 = A1 - A2 = ([-+.0-9]+) ", c1).group(1)) == pytest.approx(0.01, abs=2e-3)
  smallest = 0.3 * math.log(1.05) / math.log(8)  # baseline slope -0.3 over ln(2000/250)
  assert float(re.search(r"over ln\(2000/250\) = ([0-9.]+)\.", text).group(1)) == pytest.approx(
      smallest, rel=0.03)
  assert "A1 vs A2 wgrad operand errors lhs_err 0.1050 vs 0.1000 (+5.0%)" in text
  assert "C1 is CONFOUNDED" in text
  curves = horizon.contrast_curves(report.load_runs(folder), declaration.load(
      str(tmp_path / "DECLARATION.json")))
  assert curves["C1 = A1 - A2"][1].shape == (3, steps.size)


def _diverged_study(folder, rule=None):
  """Three seeds of A0, A1, A2 (A1 0.02 nats per e-fold worse than A2, its
  Wgrad snr_true below sqrt(3)); A1 seed 2's validation loss NaN from step
  1500, and A0 seed 1 stopped by the trainer (finite losses)."""
  rng = np.random.default_rng(2)
  steps = np.arange(0, 2001, 250)
  ln = np.log(np.maximum(steps, 1))
  for seed in range(3):
    base = 4.0 - 0.3 * ln + rng.normal(0, 0.01, steps.size)
    _write_run(folder, "A0", seed, steps, base, status="diverged" if seed == 1 else "completed")
    _write_run(folder, "A2", seed, steps, base + 0.001 * rng.normal(size=steps.size), 0.1)
    a1 = base + (0.02 + 0.001 * rng.normal()) * ln
    if seed == 2:
      a1[steps >= 1500] = math.nan
    _write_run(folder, "A1", seed, steps, a1, 0.1, snr_true=1.0)
  decl = dict(DECLARATION, **({} if rule is None else dict(diverged=rule)))
  with open(os.path.join(folder, "DECLARATION.json"), "w") as f:
    json.dump(decl, f)


def test_a_diverged_run_is_named_and_counts_by_the_declared_rule(tmp_path, capsys):
  """By default (exclude) a diverged run's seed leaves its contrasts, which
  say so (n=2 of 3); the report and horizon.md name the run; no '+nan'."""
  folder = str(tmp_path / "study")
  _diverged_study(folder)
  assert horizon.main(["horizon", "e1", folder]) == 0
  assert report.main(["report", folder, "--baseline=A0"]) == 0, capsys.readouterr().err
  for name in ("horizon.md", "table.md"):
    text = (tmp_path / "study" / name).read_text()
    assert "+nan" not in text, name
    assert ("count by the declaration's rule `diverged: exclude` (the default)" in text
            and "Diverged: A0 seed 1 (stopped by the trainer on non-finite steps), A1 seed 2 "
            "(validation loss nan at step 1500)." in text), name
    c1 = next(l for l in text.splitlines() if l.startswith("- **") and "C1 = A1 - A2" in l)
    assert c1.startswith("- **supported**: C1") and c1.endswith(
        "n=2 of 3 seeds; diverged, left out: A1 seed 2).")
    c3 = next(l for l in text.splitlines() if l.startswith("- **") and "C3 = A2 - A0" in l)
    assert c3.endswith("n=2 of 3 seeds; diverged, left out: A0 seed 1).")
  assert "| A1 | 1 (+2 with a diverged run) |" in (tmp_path / "study" / "table.md").read_text()
  # The other rule: no verdict on a claim with a diverged run, its p taken as 1.
  folder = str(tmp_path / "strict")
  _diverged_study(folder, "inconclusive")
  assert horizon.main(["horizon", "e1", folder]) == 0
  text = (tmp_path / "strict" / "horizon.md").read_text()
  assert "rule `diverged: inconclusive`:" in text
  c1 = next(l for l in text.splitlines() if l.startswith("- **") and "C1 = A1 - A2" in l)
  assert c1.startswith("- **inconclusive**: C1. Not judged: a run diverged (claim p taken as 1)")
  with open(os.path.join(folder, "DECLARATION.json"), "w") as f:
    json.dump(dict(DECLARATION, diverged="worst"), f)
  with pytest.raises(errors.UserError, match="diverged 'worst' is not one of exclude, "
                     "inconclusive"):
    declaration.load(os.path.join(folder, "DECLARATION.json"))


@pytest.mark.parametrize("study", ["sr_bias_tiny", "horizon_tiny"])
def test_the_committed_declarations_load_with_the_default_rule(study):
  path = os.path.join(ROOT, "results", study, "DECLARATION.json")
  assert declaration.load(path).diverged == "exclude"
  assert declaration.status(os.path.dirname(path), path) == "declared"


def test_operand_errors_and_the_validity_rule():
  rows = [{"step": 1, "diag/train/block_0/attn/q/wgrad/lhs_err": 0.10,
           "diag/train/block_0/attn/q/wgrad/rhs_err": 0.20,
           "diag/ref/block_0/attn/q/wgrad/lhs_err": 9.0},
          {"step": 2, "diag/train/block_0/attn/q/wgrad/lhs_err": 0.12,
           "diag/train/block_0/attn/q/wgrad/rhs_err": 0.22}]
  run = report.Run("A1", 0, "", rows, np.zeros(0), np.zeros(0), "completed", 0, None)
  errs = horizon.operand_errors([run])
  assert errs == pytest.approx({"lhs_err": 0.11, "rhs_err": 0.21})
  assert horizon.errors_match(errs, {"lhs_err": 0.11 * 1.02, "rhs_err": 0.21})
  assert not horizon.errors_match(errs, {"lhs_err": 0.11 * 1.05, "rhs_err": 0.21})


def test_stress_outcome_on_a_synthetic_run():
  losses = [5.0, 4.0, 3.0, 3.5, 3.9, float("nan"), 4.1, 2.5]
  rows = [dict(step=i + 1, loss=l, skipped_steps=int(i >= 5)) for i, l in enumerate(losses)]
  rows.append(dict(step=8, eval_loss=2.7))
  out = horizon.stress_outcome(rows)
  # 3.9 is 0.9 above the running minimum 3.0; 4.1 (step 7) is 1.1 above.
  assert out == horizon.StressOutcome(first_nonfinite=6, skipped=1, first_blowup=7,
                                      final_eval_loss=2.7)
  calm = horizon.stress_outcome([dict(step=1, loss=3.0), dict(step=2, loss=3.9)])
  assert calm == horizon.StressOutcome(None, 0, None, None)


def test_the_stress_table_reads_one_study_per_lr(tmp_path):
  for lr, loss in (("1e-2", 3.0), ("3e-2", float("inf"))):
    path = tmp_path / f"lr{lr}" / "A1"
    path.mkdir(parents=True)
    path.joinpath("metrics.jsonl").write_text(
        json.dumps(dict(step=0, tokens=0, eval_loss=5.0)) + "\n"
        + json.dumps(dict(step=1, tokens=10, loss=loss, skipped_steps=int(lr == "3e-2"))) + "\n")
    path.joinpath("summary.json").write_text(json.dumps(dict(status="completed")))
  table = "\n".join(horizon.stress_table(str(tmp_path)))
  assert "| 1e-2 | A1 | - | 0 | - | 5.0000 | completed |" in table
  assert "| 3e-2 | A1 | 1 | 1 | - | 5.0000 | completed |" in table
  assert horizon.main(["horizon", "stress", str(tmp_path)]) == 0
  assert (tmp_path / "table.md").read_text().count("| A1 |") == 2


# ------------------------------------------- declaration and committed results

def _finished_run(path, status="completed", loss=3.0, cfg=None):
  """A finished run's records; config.json is `cfg`'s as the trainer writes it."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step in (0, 2):
      f.write(json.dumps(dict(step=step, tokens=step * 10, eval_loss=loss + 2 - step)) + "\n")
  saved = {} if cfg is None else dict(json.loads(cfg.to_json()), resolved={})
  for name, obj in (("summary.json", dict(status=status)), ("config.json", saved),
                    ("wall.json", dict(wall_s=1.0))):
    with open(os.path.join(path, name), "w") as f:
      json.dump(obj, f)


def test_publish_is_complete_only_with_its_manifest_and_a_finished_run(tmp_path):
  src, dst = str(tmp_path / "work" / "A0_seed0"), str(tmp_path / "results" / "A0_seed0")
  _finished_run(src)
  committed.publish(src, dst)
  assert committed.is_complete(dst)
  assert sorted(os.listdir(tmp_path / "results")) == ["A0_seed0"]  # no temporary left
  os.makedirs(tmp_path / "results" / ".A1_seed0.tmp")  # a copy cut short: not a run
  _finished_run(str(tmp_path / "results" / ".A1_seed0.tmp"))
  assert list(report.load_runs(str(tmp_path / "results"))) == ["A0"]
  with open(os.path.join(dst, "metrics.jsonl"), "a") as f:
    f.write("{}\n")
  assert not committed.is_complete(dst)  # a file that differs from its manifest
  committed.publish(src, dst)  # replaced whole
  assert committed.is_complete(dst)
  _finished_run(src, status="interrupted")
  committed.publish(src, dst)
  assert not committed.is_complete(dst)


def _study(tmp_path):
  config = _load_config("horizon_tiny")
  config.ablation.arms = "A0=mxfp4-dh16; A1=mxfp4-dh16:wgrad.hadamard.signs=per-step"
  config.ablation.seeds, config.ablation.recipe_seeds = 2, ""
  config.ablation.compilation_cache = ""
  config.ablation.cpus_per_run = 0  # in this process
  config.ablation.declaration = str(tmp_path / "DECLARATION.json")
  config.diagnostics.enabled = False
  return config


@pytest.mark.slow
def test_the_study_resumes_from_the_results_folder(tmp_path, monkeypatch, capsys):
  config = _study(tmp_path)
  work, results = str(tmp_path / "work"), str(tmp_path / "results")
  trained = []

  def fake_train(cfg, arm, seed, path):
    assert os.path.exists(os.path.join(results, declaration.RECORD))  # declared first
    trained.append(os.path.basename(path))
    _finished_run(path, loss=3.0 + seed, cfg=ablation.run_config(config, arm, seed))
    return dict(status="completed")

  monkeypatch.setattr(ablation, "_train", fake_train)
  with pytest.raises(errors.UserError, match="declaration"):  # none yet: nothing runs
    ablation.run_ablation(config, work, results)
  decl = dict(DECLARATION, claims=DECLARATION["claims"][:1], validity=[])
  (tmp_path / "DECLARATION.json").write_text(json.dumps(decl))
  elsewhere = str(tmp_path / "elsewhere" / "A1_seed0")  # another machine's finished run
  _finished_run(elsewhere, cfg=ablation.run_config(config, ablation.arm_list(config)[1], 0))
  committed.publish(elsewhere, os.path.join(results, "A1_seed0"))
  with pytest.raises(errors.UserError, match="not recorded before the first run"):
    ablation.run_ablation(config, work, results)
  assert not trained
  os.remove(os.path.join(results, "A1_seed0", committed.MANIFEST))
  ablation.run_ablation(config, work, results)
  assert declaration.status(results, config.ablation.declaration) == "declared"
  assert trained == ["A0_seed0", "A1_seed0", "A0_seed1", "A1_seed1"]  # seed-major
  assert all(committed.is_complete(os.path.join(results, r)) for r in trained)
  assert (tmp_path / "results" / "table.md").is_file()
  assert json.load(open(os.path.join(results, "arms.json")))["A1"]["recipe"] == (
      "mxfp4-dh16[wgrad.hadamard.signs=per-step]")
  # The workdir gone (another machine), one run's records not complete: only it trains.
  trained.clear()
  os.remove(os.path.join(results, "A0_seed1", "wall.json"))
  capsys.readouterr()
  ablation.run_ablation(config, str(tmp_path / "fresh_work"), results)
  assert trained == ["A0_seed1"]
  assert "A1_seed1 complete in the results, skipped" in capsys.readouterr().out
  (tmp_path / "DECLARATION.json").write_text(json.dumps(dict(decl, alpha=0.01)))
  with pytest.raises(errors.UserError, match="changed after the study began"):
    ablation.run_ablation(config, work, results)


def _git(repo, *args):
  return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def test_git_commit_commits_the_results_folder_only(tmp_path):
  repo = str(tmp_path)
  _git(repo, "init", "-q")
  _git(repo, "config", "user.email", "t@example.com")
  _git(repo, "config", "user.name", "t")
  (tmp_path / "code.py").write_text("x = 1\n")
  _git(repo, "add", "code.py")
  _git(repo, "commit", "-qm", "code")
  (tmp_path / "code.py").write_text("x = 2\n")
  (tmp_path / "other.py").write_text("y\n")
  _git(repo, "add", "code.py", "other.py")  # someone's staged work
  _finished_run(str(tmp_path / "results" / "A0_seed0"))
  commit = committed.git_commit([str(tmp_path / "results" / "A0_seed0")], "results: A0 seed 0")
  assert commit and _git(repo, "log", "-1", "--format=%s") == "results: A0 seed 0\n"
  files = _git(repo, "show", "--name-only", "--format=", "HEAD").split()
  assert files == [f"results/A0_seed0/{n}" for n in
                   ("config.json", "metrics.jsonl", "summary.json", "wall.json")]
  assert sorted(_git(repo, "diff", "--cached", "--name-only").split()) == ["code.py", "other.py"]
  assert committed.git_commit([str(tmp_path / "results")], "nothing new") is None
  with pytest.raises(errors.UserError, match="not in a git work tree"):
    committed.git_commit([str(tmp_path.parent)], "outside")


def _snr_run(seed, values_by_step):
  rows = [{"step": s, "diag/train/block_0/attn/q/wgrad/snr_true": v,
           "diag/train/block_3/mlp/down/wgrad/snr_true": 2 * v,
           "diag/train/block_0/attn/q/fprop/snr_true": 0.0}
          for s, v in values_by_step.items()]
  return report.Run("A1", seed, "", rows, np.zeros(0), np.zeros(0), "completed", 0, None)


def test_the_snr_figure_takes_the_median_over_seeds():
  """One seed's snr_true clipped to 0 leaves the median (a geometric mean would be 0)."""
  runs = {"A1": [_snr_run(0, {1: 0.0, 2: 4.0}), _snr_run(1, {1: 2.0, 2: 1.0}),
                 _snr_run(2, {1: 3.0, 2: 8.0})]}
  steps, values = report.snr_series(runs)["A1"][("block_0/attn/q", "wgrad", "snr_true")]
  np.testing.assert_array_equal(steps, [1, 2])
  np.testing.assert_array_equal(values, [2.0, 4.0])


def test_the_snr_crossing_is_the_first_window_whose_median_is_below_sqrt3():
  # Windows (1, 2), (250-252), (500-502); layer values v and 2v, two seeds.
  high = {1: 5.0, 2: 5.0, 250: 2.0, 251: 0.0, 252: 2.0, 500: 0.5, 501: 0.6, 502: 0.0}
  runs = [_snr_run(0, high), _snr_run(1, high)]
  # 250-252: median of {2, 0, 2, 4, 0, 4} x 2 seeds = 2 > sqrt(3); 500: 0.6 x ... < sqrt(3).
  assert horizon.snr_crossing(runs) == 500
  assert horizon.snr_crossing(runs, threshold=2.5) == 250
  assert horizon.snr_crossing(runs, role="dgrad") is None
  assert horizon.snr_crossing([_snr_run(0, {1: 9.0, 250: 9.0})]) is None


def test_the_crossing_lines_split_the_paired_difference_at_the_mark():
  steps = np.array([0, 250, 500, 750, 1000], np.float64)
  diff = np.array([[0.0, 0.01, 0.02, 0.05, 0.07], [0.0, 0.03, 0.02, 0.07, 0.09]])
  lines = horizon.crossing_lines({"A1": 750, "A2": None}, {"C1 = A1 - A2": (steps, diff)},
                                 {"C1 = A1 - A2": 750})
  assert "A1 at step 750, A2 never" in lines[0] and "median" in lines[0]
  assert lines[1] == ("- C1 = A1 - A2: mean paired difference before step 750 +0.0200 "
                      "(2 evaluations), from it on +0.0700 (2 evaluations) (contrasts.png: "
                      "dashed line).")


@pytest.mark.parametrize("module", [horizon, report])
def test_help_prints_the_usage_and_exits_0(module, capsys):
  assert module.main(["prog", "--help"]) == 0
  assert capsys.readouterr().out.startswith("usage: python -m fp4jax.experiments.")
