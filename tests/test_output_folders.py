"""No command writes over a run: the folders an export or a study replaces.

One tiny trained run is copied into a workdir beside a second run; each case
points a command's output folder at it (the run itself, a folder inside it,
the workdir above it, a symbolic link) and checks that the command is refused
in one line with exit status 2 and that every file of the workdir is still
there, byte for byte (fp4jax.train.run_layout.check_output).
"""

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from fp4jax import errors
from fp4jax.experiments import ablation
from fp4jax.train import atomic
from fp4jax.train import export
from fp4jax.train import trainer
from sharded_runs import on_first_devices
from tests.helpers import tiny_config

pytestmark = pytest.mark.slow  # a trained run, and commands as processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT = "python -m fp4jax.convert"


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
  return env


def _cli(*args):
  """(exit status, stdout + stderr) of `python -m MODULE ARGS`."""
  out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=240, check=False)
  return out.returncode, out.stdout + out.stderr


def _files(folder):
  """{path relative to folder: sha256} of every file below it (links as links)."""
  out = {}
  for directory, folders, names in os.walk(folder):
    for name in folders + names:
      path = os.path.join(directory, name)
      key = os.path.relpath(path, folder)
      if os.path.islink(path):
        out[key] = "-> " + os.readlink(path)
      elif name in names:
        with open(path, "rb") as f:
          out[key] = hashlib.sha256(f.read()).hexdigest()
  return out


def _refused(rc, out, *names):
  assert rc == 2, out[-3000:]
  assert "Traceback" not in out and out.strip().count("\n") == 0, out[-3000:]
  for name in names:
    assert name in out, (name, out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  run = str(tmp_path_factory.mktemp("trained") / "run")
  with on_first_devices(1):
    trainer.train(tiny_config(steps=4, eval_every=4, async_checkpointing=False), run)
  assert {"config.json", "metrics.jsonl", "summary.json", "checkpoints"} <= set(
      os.listdir(run))
  return run


@pytest.fixture
def workdir(trained, tmp_path):
  """A workdir of two copies of the trained run, a and b."""
  for name in ("a", "b"):
    shutil.copytree(trained, tmp_path / "runs" / name, symlinks=True)
  return tmp_path / "runs"


def test_an_export_over_the_run_it_reads_is_refused(workdir, capsys):
  run, before = str(workdir / "a"), _files(workdir)
  rc, out = _cli("fp4jax.convert", "export", run, run, "--quantize", "nvfp4",
                 "--overwrite")
  _refused(rc, out, f"OUT_DIR '{run}' is '{run}', which this command reads")
  cases = [  # (OUT_DIR, what the message says)
      (os.path.join(run, "checkpoints"), f"lies inside '{run}'"),
      (os.path.join(run, "checkpoints", "4"), f"lies inside '{run}'"),
      (os.path.join(run, "new"), f"lies inside '{run}'"),
      (str(workdir), f"holds '{run}'"),
      (str(workdir / "b"), "is a run or checkpoint"),
      (os.path.join(workdir, "b", "checkpoints"), f"lies inside '{workdir / 'b'}'")]
  for out_dir, message in cases:
    assert export.main(["export", run, out_dir, "--quantize", "nvfp4",
                        "--overwrite"]) == 2, out_dir
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"OUT_DIR '{out_dir}' {message}" in err, err
  assert _files(workdir) == before


def test_a_workdir_above_other_runs_is_refused(workdir, trained, tmp_path, capsys):
  before = _files(workdir)
  assert export.main(["export", trained, str(workdir), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and (
      f"OUT_DIR '{workdir}' holds the run or checkpoint '{workdir / 'a'}'") in err, err
  (workdir / "notes").mkdir()  # a folder below holds the runs
  shutil.move(workdir / "a", workdir / "notes" / "a")
  shutil.move(workdir / "b", workdir / "notes" / "b")
  assert export.main(["export", trained, str(workdir), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"OUT_DIR '{workdir}' exists and is not an export" in err
  assert _files(workdir) == {os.path.join("notes", k): v for k, v in before.items()}


def test_overwrite_replaces_an_export_and_nothing_else(trained, tmp_path, capsys):
  (tmp_path / "checkpoints").mkdir()  # another tool's, in the folder above: not a run
  (tmp_path / "checkpoints" / "model.pt").write_text("x")
  out_dir = str(tmp_path / "hf")
  assert export.main(["export", trained, out_dir]) == 0
  first = _files(out_dir)
  assert export.main(["export", trained, out_dir]) == 2  # kept without --overwrite
  assert "pass --overwrite" in capsys.readouterr().err
  with open(os.path.join(out_dir, "README.md"), "w") as f:
    f.write("notes")  # a file a user added: the export is still an export
  assert export.main(["export", trained, out_dir, "--overwrite"]) == 0
  assert _files(out_dir) == first and sorted(os.listdir(tmp_path)) == ["checkpoints", "hf"]
  mine = tmp_path / "mine"
  (mine / "data").mkdir(parents=True)
  (mine / "data" / "keep.txt").write_text("keep")
  (tmp_path / "hf.partial" / "data").mkdir(parents=True)  # not a killed export's
  for target, message in (
      (str(mine), f"OUT_DIR '{mine}' exists and is not an export"),
      (out_dir, f"OUT_DIR.partial '{out_dir}.partial' exists and is not a partial export")):
    capsys.readouterr()
    assert export.main(["export", trained, target, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
  assert (mine / "data" / "keep.txt").read_text() == "keep"
  assert _files(out_dir) == first and os.listdir(tmp_path / "hf.partial") == ["data"]


def _export_refused(capsys, *args, message):
  capsys.readouterr()
  assert export.main(["export", *map(str, args)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err


def test_a_symbolic_link_out_dir_is_refused_naming_its_target(trained, tmp_path, capsys):
  exports = tmp_path / "exports"
  assert export.main(["export", trained, str(exports / "v1")]) == 0
  (exports / "latest").symlink_to("v1")
  before = _files(exports)
  for _ in range(2):  # the same answer again: nothing was moved
    _export_refused(capsys, trained, exports / "latest", "--overwrite",
                    message=f"OUT_DIR '{exports / 'latest'}' is a symbolic link to 'v1'")
    assert _files(exports) == before and sorted(os.listdir(exports)) == ["latest", "v1"]
  (exports / "v2.partial").symlink_to("v1")  # what such an export left before
  _export_refused(capsys, trained, exports / "v2",
                  message=f"OUT_DIR.partial '{exports / 'v2'}.partial' is a symbolic link")
  assert _files(exports) == dict(before, **{"v2.partial": "-> v1"})


def _ablation_config():
  spec = importlib.util.spec_from_file_location(
      "ablation_tiny", os.path.join(ROOT, "configs", "ablation_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.ablation.recipes, config.ablation.baseline = "bf16", "bf16"
  config.ablation.seeds, config.ablation.recipe_seeds = 1, ""
  return config


def test_the_ablation_results_never_replace_a_run(workdir, tmp_path):
  config, work = _ablation_config(), str(tmp_path / "work")
  study = str(tmp_path / "study")  # --results = --workdir: each run published over itself
  run = os.path.join(study, "bf16")
  with pytest.raises(errors.UserError, match=re.escape(
      f"--results run folder '{run}' is '{run}', which this command trains a run in")):
    ablation.run_ablation(config, study, study)
  assert not os.path.exists(study)  # refused before anything was written
  before = _files(workdir)
  (workdir / "bf16" / "data").mkdir(parents=True)  # the user's, where a run would go
  for results, message in (
      (workdir / "a" / "results", f"'{workdir / 'a' / 'results' / 'bf16'}' lies inside "
       f"'{workdir / 'a'}', a run or checkpoint"),
      (workdir / "a", f"'{workdir / 'a' / 'bf16'}' lies inside '{workdir / 'a'}'"),
      (workdir, f"'{workdir / 'bf16'}' exists and is not a run's published records")):
    with pytest.raises(errors.UserError, match=re.escape(message)):
      ablation.run_ablation(config, work, str(results))
  os.rmdir(workdir / "bf16" / "data")
  os.rmdir(workdir / "bf16")
  assert _files(workdir) == before and not os.path.exists(work)


# ---------------------------------------------------------------------------
# Paths as the OS resolves them, what an export may remove, one writer.


def test_an_out_dir_through_a_link_and_dotdot_is_the_folder_the_os_resolves(
    trained, tmp_path, capsys):
  exports, other = tmp_path / "exports", tmp_path / "other"
  (other / "sub").mkdir(parents=True)
  assert export.main(["export", trained, str(exports / "victim")]) == 0
  (exports / "victim" / "README.md").write_text("another export's notes")
  (exports / "alink").symlink_to(other / "sub")
  before = _files(exports)
  out_dir = str(exports / "alink" / ".." / "victim")  # POSIX: other/victim
  assert export.main(["export", trained, out_dir, "--overwrite"]) == 0, (
      capsys.readouterr().err)
  assert f"wrote {other / 'victim'}:" in capsys.readouterr().out
  assert _files(exports) == before  # the other export is untouched
  assert export.is_export(str(other / "victim"))
  assert sorted(os.listdir(other)) == ["sub", "victim"]  # no .partial, no .lock left


def test_a_partial_folder_without_the_export_mark_is_never_removed(trained, tmp_path, capsys):
  out_dir = tmp_path / "hf"
  (tmp_path / "hf.partial").mkdir()
  (tmp_path / "hf.partial" / "notes.txt").write_text("mine")
  before = _files(tmp_path)
  _export_refused(capsys, trained, out_dir, message=(
      f"OUT_DIR.partial '{out_dir}.partial' exists and is not a partial export"))
  assert _files(tmp_path) == before and not out_dir.exists()
  shutil.rmtree(tmp_path / "hf.partial")
  atomic.mark_partial(str(tmp_path / "hf.partial"))  # what a killed export leaves
  (tmp_path / "hf.partial" / "model.safetensors").write_text("half")
  assert export.main(["export", trained, str(out_dir)]) == 0
  assert sorted(os.listdir(tmp_path)) == ["hf"] and export.is_export(str(out_dir))
  assert atomic.PARTIAL_MARK not in os.listdir(out_dir)


def test_a_file_named_like_the_partial_folder_is_refused_in_one_line(trained, tmp_path, capsys):
  out_dir = tmp_path / "hf"
  (tmp_path / "hf.partial").write_text("a file of the user's")
  _export_refused(capsys, trained, out_dir, message=(
      f"OUT_DIR.partial '{out_dir}.partial' exists and is a file, not a folder"))
  assert sorted(os.listdir(tmp_path)) == ["hf.partial"]
  assert (tmp_path / "hf.partial").read_text() == "a file of the user's"


def test_the_current_folder_or_an_empty_out_dir_is_refused_before_reading(
    trained, tmp_path, monkeypatch, capsys):
  (tmp_path / "work" / "here").mkdir(parents=True)
  monkeypatch.chdir(tmp_path / "work" / "here")
  _export_refused(capsys, trained, "", message="OUT_DIR is empty")
  _export_refused(capsys, trained, ".", message="OUT_DIR '.' is the current folder")
  _export_refused(capsys, trained, "..", message="holds the current folder")
  _export_refused(capsys, trained, tmp_path / "work", message="holds the current folder")
  assert os.listdir(tmp_path) == ["work"] and os.listdir(tmp_path / "work") == ["here"]
  assert os.listdir(tmp_path / "work" / "here") == []  # nothing written, no .partial


def _hold_lock(out_dir):
  """An open file holding the OS lock of OUT_DIR.lock, as a running export does."""
  f = open(f"{out_dir}.lock", "a+")  # pylint: disable=consider-using-with
  fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  return f


def test_one_export_at_a_time_writes_an_out_dir(trained, tmp_path, capsys):
  out_dir = tmp_path / "hf"
  held = _hold_lock(out_dir)  # another export is writing hf
  try:
    rc, out = _cli("fp4jax.convert", "export", trained, str(out_dir))
    _refused(rc, out, f"OUT_DIR '{out_dir}': another command", "is writing it now",
             f"{out_dir}.lock")
    _export_refused(capsys, trained, out_dir, message="is writing it now")
    assert sorted(os.listdir(tmp_path)) == ["hf.lock"]  # nothing written
  finally:
    held.close()
  assert export.main(["export", trained, str(out_dir)]) == 0
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # the lock is gone with the export
  (tmp_path / "hf.lock").write_text("my notes\n")  # a user's file of that name
  _export_refused(capsys, trained, out_dir, "--overwrite",
                  message=f"'{out_dir}.lock' exists and is not a lock fp4jax wrote")
  assert (tmp_path / "hf.lock").read_text() == "my notes\n"


def test_an_export_inside_a_studys_published_run_is_refused(trained, tmp_path, capsys):
  published = tmp_path / "results" / "bf16"  # what a study publishes: records, no checkpoints/
  published.mkdir(parents=True)
  for name in ("config.json", "metrics.jsonl", "summary.json"):
    shutil.copy(os.path.join(trained, name), published)
  before = _files(tmp_path)
  for out_dir, message in ((published / "hf", f"lies inside '{published}'"),
                           (published, "is a run or checkpoint")):
    _export_refused(capsys, trained, out_dir, "--overwrite",
                    message=f"OUT_DIR '{out_dir}' {message}")
  assert _files(tmp_path) == before
  mine = tmp_path / "mine"  # another tool's metrics.jsonl (and a HF config.json): no run
  mine.mkdir()
  (mine / "metrics.jsonl").write_text('{"step": 1}\n')
  (mine / "config.json").write_text('{"model_type": "llama"}')
  assert export.main(["export", trained, str(mine / "hf")]) == 0


def test_a_study_writes_only_into_its_own_results_folder(workdir, tmp_path, monkeypatch):
  config, work = _ablation_config(), str(tmp_path / "work")
  monkeypatch.setattr(ablation, "_train_all", lambda *a: pytest.fail("trained"))
  res = tmp_path / "res"
  (res / "bf16").mkdir(parents=True)
  (res / "bf16" / "draft.tex").write_text("the user's draft")
  before = _files(res)
  with pytest.raises(errors.UserError, match=re.escape(
      f"--results run folder '{res / 'bf16'}' exists and is not a run's published records")):
    ablation.run_ablation(config, work, str(res))
  assert _files(res) == before and not os.path.exists(work)
  shutil.rmtree(res / "bf16")
  (res / "table.md").write_text("the user's table")
  (res / "DECLARATION.json").write_text("{}")  # a study may start beside these
  before = _files(res)
  with pytest.raises(errors.UserError, match=re.escape(
      f"--results folder '{res}' holds table.md but is not a study's folder")):
    ablation.run_ablation(config, work, str(res))
  assert _files(res) == before and not os.path.exists(work)
  os.remove(res / "table.md")
  (res / "curves.png").symlink_to(os.path.join(workdir, "a", "metrics.jsonl"))
  with pytest.raises(errors.UserError, match="curves.png' is a symbolic link"):
    ablation.run_ablation(config, work, str(res))
  # The study's own folder: its record, its report, its published runs.
  os.remove(res / "curves.png")
  for name in ("ablation_config.json", "table.md", "arms.json"):
    (res / name).write_text("{}")
  (res / "bf16").mkdir()
  for name in ablation.PUBLISHED_FILES:
    (res / "bf16" / name).write_text("x")
  ablation.check_study_folder(str(res), "--results folder")
  assert ablation.is_published_records(str(res / "bf16"))
  (res / "bf16" / "draft.tex").write_text("the user's draft")
  assert not ablation.is_published_records(str(res / "bf16"))
