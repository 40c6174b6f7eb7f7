"""A study's records belong to one config: a rerun with another is refused
(or trains beside them), and a results folder's names stay inside it.

The runs are faked (ablation._train writes a finished run's records), so
these are fast: what is tested is which runs the runner reuses.
"""

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from fp4jax import errors
from fp4jax.experiments import ablation
from fp4jax.experiments import committed
from fp4jax.experiments import report
from fp4jax.experiments import study_config
from fp4jax.train import config as train_config


def _config():
  config = train_config.base_config()
  config.steps = 4
  config.ablation = ablation.ablation_config()
  config.ablation.recipes, config.ablation.compilation_cache = "bf16,fp8", ""
  config.ablation.cpus_per_run = 0  # in this process
  config.diagnostics = ablation.diagnostics_config()
  config.diagnostics.enabled = False
  return config


def write_finished_run(path, cfg, status="completed"):
  """A finished run's records as the trainer and the runner write them."""
  os.makedirs(path, exist_ok=True)
  rows = [dict(step=s, tokens=s * 10, eval_loss=5.0 - s) for s in (0, 2, 4)]
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  records = {"summary.json": dict(status=status, step=4),
             "config.json": dict(json.loads(cfg.to_json()), resolved={}),
             "wall.json": dict(wall_s=1.0)}
  for name, obj in records.items():
    with open(os.path.join(path, name), "w") as f:
      json.dump(obj, f)


@pytest.fixture
def fake_training(monkeypatch):
  trained = []

  def fake_train(config, arm, seed, path):
    trained.append(path)
    write_finished_run(path, ablation.run_config(config, arm, seed))
    return dict(status="completed")

  monkeypatch.setattr(ablation, "_train", fake_train)
  monkeypatch.setattr(ablation, "_report", lambda *args: [])
  return trained


@pytest.mark.parametrize("with_results", [False, True], ids=["workdir", "results"])
def test_a_study_rerun_with_another_config_is_refused(tmp_path, fake_training,
                                                      with_results):
  work = str(tmp_path / "work")
  results = str(tmp_path / "results") if with_results else None
  out = results or work
  config = _config()
  ablation.run_ablation(config, work, results)
  assert len(fake_training) == 2
  record = (tmp_path / os.path.basename(out) / study_config.RECORD).read_text()
  for key, value in (("steps", 6), ("lr", 1e-3)):
    other = _config()
    other[key] = value
    with pytest.raises(errors.UserError, match=rf"{key}: .* -> {value}"):
      ablation.run_ablation(other, work, results)
    assert len(fake_training) == 2  # nothing trained, nothing overwritten
    assert (tmp_path / os.path.basename(out) / study_config.RECORD).read_text() == record
  # Without the study's record, the finished runs' own configs still tell.
  os.remove(os.path.join(out, study_config.RECORD))
  if results:
    os.remove(os.path.join(work, study_config.RECORD))
  with pytest.raises(errors.UserError, match=r"finished run .*bf16: lr: "):
    ablation.run_ablation(other, work, results)
  ablation.run_ablation(config, work, results)  # the same config: all reused
  assert len(fake_training) == 2
  # An explicit flag trains the other config beside the old runs.
  ablation.run_ablation(other, work, results, new_runs_beside=True)
  beside = study_config.beside(out, other)
  assert len(fake_training) == 4
  assert all(p.startswith(study_config.beside(work, other)) for p in fake_training[2:])
  assert os.path.isfile(os.path.join(beside, "fp8", "config.json"))
  assert json.loads(open(os.path.join(out, "bf16", "config.json")).read())["lr"] == config.lr


def test_a_forged_manifest_does_not_make_a_run_complete(tmp_path):
  run = tmp_path / "results" / "bf16"
  write_finished_run(str(tmp_path / "work" / "bf16"), _config())
  committed.publish(str(tmp_path / "work" / "bf16"), str(run))
  assert committed.is_complete(str(run))
  outside = tmp_path / "outside.txt"
  outside.write_text("not a run's file")
  digest = hashlib.sha256(outside.read_bytes()).hexdigest()
  manifest = json.loads((run / committed.MANIFEST).read_text())
  for name in ("../../outside.txt", str(outside)):
    forged = dict(manifest["files"], **{name: digest})
    (run / committed.MANIFEST).write_text(json.dumps({"files": forged}))
    assert not committed.is_complete(str(run)), forged
  # A manifest of only some files: the run's own files are needed.
  files = dict(manifest["files"])
  del files["metrics.jsonl"]
  (run / committed.MANIFEST).write_text(json.dumps({"files": files}))
  assert not committed.is_complete(str(run))


def _git_repo(path):
  os.makedirs(path)
  subprocess.run(["git", "init", "-q", path], check=True)


def test_git_commit_preconditions_are_checked_before_anything(tmp_path, fake_training):
  """--git_commit with results outside any git work tree, or a declaration
  outside the results' repository: refused before a record is written or a
  run trains."""
  config = _config()
  work, results = str(tmp_path / "work"), str(tmp_path / "results")
  with pytest.raises(errors.UserError, match=r"--git_commit: .*results' is not in a git work "
                     "tree"):
    ablation.run_ablation(config, work, results, git_commit=True)
  _git_repo(str(tmp_path / "repo"))
  (tmp_path / "DECLARATION.json").write_text("{}")
  config.ablation.declaration = str(tmp_path / "DECLARATION.json")
  for _ in range(2):  # the same command again: still refused
    with pytest.raises(errors.UserError, match=r"DECLARATION.json' is not inside the "
                       "repository"):
      ablation.run_ablation(config, work, str(tmp_path / "repo" / "results"), git_commit=True)
  assert not fake_training and not os.path.exists(tmp_path / "repo" / "results")


def test_results_folder_mistakes_name_the_results_folder(tmp_path, fake_training):
  os.symlink(str(tmp_path / "gone"), str(tmp_path / "dangling"))
  with pytest.raises(errors.UserError, match=r"^--results folder '.*dangling' is a symbolic "
                     "link"):
    ablation.run_ablation(_config(), str(tmp_path / "work"), str(tmp_path / "dangling"))
  (tmp_path / "file").write_text("x")
  with pytest.raises(errors.UserError, match=r"^--results folder '.*file' is a file"):
    ablation.run_ablation(_config(), str(tmp_path / "work"), str(tmp_path / "file"))


def test_an_interrupted_study_says_so_and_reports_nothing(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(ablation, "_train", lambda *a: dict(
      status="interrupted", message="stopped by SIGTERM at step 3"))
  assert ablation.run_ablation(_config(), str(tmp_path / "work")) == []
  out = capsys.readouterr().out
  assert ("ablation: interrupted (stopped by SIGTERM at step 3; a checkpoint was saved); "
          "run the same command again to resume") in out, out
  assert not (tmp_path / "work" / "table.md").exists()


def test_a_refused_start_leaves_no_record_behind(tmp_path, fake_training):
  """A start refused for its cores or a trainer key writes nothing, so the
  corrected command starts the study."""
  work = tmp_path / "work"
  for key, value, match in (("ablation.cpus_per_run", len(os.sched_getaffinity(0)) + 1,
                             r"cpus_per_run=\d+ needs \d+ cores"),
                            ("steps", 0, r"config.steps must be >= 1, got 0")):
    config = _config()
    if key.startswith("ablation."):
      config.ablation[key[len("ablation."):]] = value
    else:
      config[key] = value
    with pytest.raises(errors.UserError, match=match):
      ablation.run_ablation(config, str(work))
    assert not work.exists() and not fake_training
  ablation.run_ablation(_config(), str(work))
  assert len(fake_training) == 2


def test_a_record_no_run_began_under_is_named(tmp_path, monkeypatch):
  """A start that recorded its config and stopped before its first run (here
  at the trainer's start-up): the rerun with another config is told which
  record blocks it and that no run began."""
  def refused(*args):
    raise train_config.ConfigError("bad config: no such training file")

  monkeypatch.setattr(ablation, "_train", refused)
  work = str(tmp_path / "work")
  with pytest.raises(errors.UserError, match="no such training file"):
    ablation.run_ablation(_config(), work)
  other = _config()
  other.steps = 6
  record = os.path.join(work, study_config.RECORD)
  with pytest.raises(errors.UserError) as refusal:
    ablation.run_ablation(other, work)
  assert str(refusal.value).startswith(
      f"{work!r} holds the record of another config ({record}: steps: 4 -> 6), and no run "
      f"of it began (an earlier start stopped before its first run): remove that "
      f"{study_config.RECORD} to start this config in its place")


_DECLARED = dict(baseline="fp8", primary="final", late_from=0.5, smallest_effect_tokens=0.05,
                 alpha=0.05, correction="holm", power=0.8, claims=[dict(
                     text="bf16 differs", contrasts=[dict(
                         label="bf16 - fp8", weights=dict(bf16=1, fp8=-1), direction="!=")])])


def test_the_report_of_a_moved_study_reads_its_own_declaration(tmp_path, monkeypatch,
                                                               capsys):
  """ablation_config.json names the declaration as the first run's command
  did (relative to where it started); a copy of the folder, redrawn from
  anywhere, reads the DECLARATION.json inside it."""
  study = tmp_path / "study"
  for name in ("bf16", "fp8"):
    write_finished_run(str(study / name), _config())
  (study / study_config.RECORD).write_text(json.dumps(
      {"ablation": {"recipes": "bf16,fp8", "declaration": "study/DECLARATION.json"}}))
  (study / "DECLARATION.json").write_text(json.dumps(dict(_DECLARED, study="original")))
  copy = tmp_path / "elsewhere" / "study"
  shutil.copytree(study, copy)
  (copy / "DECLARATION.json").write_text(json.dumps(dict(_DECLARED, study="edited copy")))
  monkeypatch.chdir(tmp_path)  # where study/DECLARATION.json is the original's
  assert report.main(["report", str(copy)]) == 0
  assert "of study `edited copy`" in (copy / "table.md").read_text()
  # Without one of its own, the recorded path, found from here or named as missing.
  os.remove(copy / "DECLARATION.json")
  assert report.main(["report", str(copy)]) == 0
  assert "of study `original`" in (copy / "table.md").read_text()
  monkeypatch.chdir(copy)
  capsys.readouterr()
  assert report.main(["report", str(copy)]) == 2
  assert ("names the declaration 'study/DECLARATION.json' (a path from where the study's "
          "first run started), not found from here") in capsys.readouterr().err


def test_the_report_of_an_arm_study_keeps_the_arms_order(tmp_path):
  """An arm study records no recipes (ablation.recipes is ""): its redrawn
  table lists the arms in the order of its arms.json, as the runner did."""
  study = tmp_path / "study"
  for name in ("fp8", "W", "D"):
    write_finished_run(str(study / name), _config())
  (study / study_config.RECORD).write_text(json.dumps(
      {"ablation": {"recipes": "", "arms": "fp8; W=fp8; D=fp8", "declaration": ""}}))
  (study / "arms.json").write_text(json.dumps(
      {name: {"spec": name, "recipe": "fp8"} for name in ("fp8", "W", "D")}))
  assert report.main(["report", str(study)]) == 0
  table = (study / "table.md").read_text()
  assert table.index("| fp8 |") < table.index("| W |") < table.index("| D |")
