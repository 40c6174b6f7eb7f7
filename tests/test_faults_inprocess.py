"""Fault injection in-process: kills, full disks and half-written files.

A "kill" is a BaseException raised at a chosen write (nothing after it in
the program runs, and no `except Exception` catches it); a full disk is an
OSError(ENOSPC) raised at a chosen write. The runs are a tiny model of a
few steps (tests/test_trainer.py's config), made once per module, on one of
the 8 virtual devices (what is tested does not depend on the mesh; one
device compiles in half the time, and saves and restores faster).
"""

import builtins
import errno
import json
import math
import os
import re
import shutil
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import recipes
from fp4jax.data import fingerprint
from fp4jax.data import pipeline
from fp4jax.data import tokenizers
from fp4jax.experiments import report
from fp4jax.train import atomic
from fp4jax.train import config as train_config
from fp4jax.train import export
from fp4jax.train import metrics_log
from fp4jax.train import curves
from fp4jax.train import run_layout
from fp4jax.train import stall
from fp4jax.train import trainer
from fp4jax.train import workdir as workdir_lib
from fp4jax.train.metrics_log import read_metrics
from sharded_runs import on_first_devices
from tests.helpers import final_state, tiny_config

pytestmark = pytest.mark.slow  # trains (see pyproject's markers)

STEPS = dict(async_checkpointing=False)  # 8 steps, checkpoints at 4 and 8


class Killed(BaseException):
  """Stands for SIGKILL: raised at a write, caught only by the test."""


def _records(workdir):
  """Every metrics row anywhere in the workdir (metrics.jsonl, history/)."""
  rows = set()
  for directory, _, names in os.walk(workdir):
    if "metrics.jsonl" in names:
      with open(os.path.join(directory, "metrics.jsonl")) as f:
        rows |= {line.strip() for line in f if line.strip()}
  return rows


class WriteFaults:
  """Counts the writes to a workdir's own files (not checkpoints/) and
  raises `fault()` at write number `at` (1, 2, ...): after an open for
  writing (the file is created or emptied), before a rename / link, and
  at fp4jax.train.atomic's hook before it renames. Appends are not counted
  (a kill there leaves a half last row, which the readers skip)."""

  def __init__(self, monkeypatch, workdir, at, fault):
    self.workdir, self.at, self.fault, self.count = str(workdir), at, fault, 0
    real_open, real = builtins.open, {}

    def counted(path):
      path = os.path.abspath(os.fspath(path))
      rel = os.path.relpath(path, self.workdir)
      if rel.startswith("..") or rel.split(os.sep)[0] in (
          "checkpoints", "checkpoints_corrupt", "tensorboard"):
        return
      self.count += 1
      if self.count == self.at:
        raise self.fault()

    def open_(file, mode="r", *args, **kwargs):
      f = real_open(file, mode, *args, **kwargs)
      if isinstance(file, (str, os.PathLike)) and set(mode) & set("wx+"):
        try:
          counted(file)
        except BaseException:
          f.close()
          raise
      return f

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(atomic, "BEFORE_RENAME", [counted])
    for name in ("replace", "rename", "link"):
      real[name] = getattr(os, name)
      monkeypatch.setattr(os, name, lambda src, dst, *a, _f=real[name], **k: (
          counted(dst), _f(src, dst, *a, **k))[1])


@pytest.fixture(scope="module", autouse=True)
def one_device():
  """The trainer's mesh: the first of the 8 virtual devices."""
  with on_first_devices(1):
    yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished 8-step run (checkpoints at steps 4 and 8)."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  trainer.train(tiny_config(**STEPS), str(workdir))
  return workdir


@pytest.mark.parametrize("drop", [False, True], ids=["drops_nothing",
                                                     "drops_rows"])
def test_a_kill_at_every_start_up_write_loses_no_row(trained, tmp_path,
                                                     monkeypatch, drop):
  """Kills a (re)start at each of its writes in turn, then starts again:
  every row survives (in metrics.jsonl or history/) and the next start
  runs. With `drop`, the step-8 checkpoint is gone, so the restart resumes
  at step 4 and sets rows 5 to 8 aside."""
  at = 1
  while True:
    workdir = tmp_path / f"kill{at}"
    shutil.copytree(trained, workdir)
    if drop:
      shutil.rmtree(workdir / "checkpoints" / "8")
    before = _records(workdir)
    with monkeypatch.context() as m:
      faults = WriteFaults(m, workdir, at, Killed)
      try:
        trainer.train(tiny_config(**STEPS), str(workdir))
        killed = False
      except Killed:
        killed = True
    assert before <= _records(workdir), (at, before - _records(workdir))
    summary = trainer.train(tiny_config(**STEPS), str(workdir))
    assert summary["step"] == 8
    assert before <= _records(workdir), at
    assert [r["step"] for r in read_metrics(workdir)] == list(range(9))
    json.loads((workdir / "config.json").read_text())
    history = workdir / "history"
    for n in (os.listdir(history) if history.exists() else []):
      assert n.isdigit(), n  # no half copy left under history/
    if not killed:
      break
    at += 1
  assert faults.count >= 3, faults.count  # lock, config.json, summary.json


def test_a_start_that_drops_nothing_rewrites_nothing(trained, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  metrics = workdir / "metrics.jsonl"
  mtime, text = os.stat(metrics).st_mtime_ns, metrics.read_text()
  trainer.train(tiny_config(**STEPS), str(workdir))
  assert os.stat(metrics).st_mtime_ns == mtime and metrics.read_text() == text
  assert not (workdir / "history").exists()


# ---------------------------------------------------------------------------
# Every reader of metrics.jsonl takes a run in progress.


def _run_in_progress(path, half=True):
  """A run folder whose metrics.jsonl ends in a half-written row."""
  os.makedirs(path)
  rows = [dict(step=i, tokens=100 * i, eval_loss=5.0 - i) for i in range(3)]
  text = "".join(json.dumps(r) + "\n" for r in rows)
  (path / "metrics.jsonl").write_text(text + ('{"step": 3, "tok' if half
                                              else ""))
  return rows


def test_every_metrics_reader_skips_a_half_written_last_line(tmp_path):
  rows = _run_in_progress(tmp_path / "fp8")
  assert read_metrics(tmp_path / "fp8") == rows
  assert curves.eval_curve(str(tmp_path / "fp8")) == ([0, 100, 200],
                                                    [5.0, 4.0, 3.0])
  report.write_report(str(tmp_path), ["fp8"])
  assert "fp8" in (tmp_path / "table.md").read_text()
  # The trainer's restart: the half row is dropped, the rows kept.
  metrics_log.MetricsLog(str(tmp_path / "fp8"), total_steps=3, start_step=2)
  assert (tmp_path / "fp8" / "metrics.jsonl").read_text().endswith(
      json.dumps(rows[-1]) + "\n")


def test_a_damaged_middle_line_is_named(tmp_path):
  _run_in_progress(tmp_path / "run", half=False)
  with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
    f.write("garbage\n" + json.dumps(dict(step=4, tokens=1, eval_loss=1.0))
            + "\n")
  with pytest.raises(errors.UserError, match=r"metrics.jsonl line 4 is not"):
    curves.eval_curve(str(tmp_path / "run"))


def test_report_on_one_run_folder_says_to_pass_its_parent(tmp_path):
  _run_in_progress(tmp_path / "fp8")
  with pytest.raises(errors.UserError, match="folder of one run") as e:
    report.write_report(str(tmp_path / "fp8"))
  assert repr(str(tmp_path)) in str(e.value)


# ---------------------------------------------------------------------------
# A full disk: one line naming the path, nothing half-written left.


def _enospc():
  return OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_an_atomic_write_keeps_the_old_file(tmp_path,
                                                           monkeypatch):
  path = tmp_path / "config.json"
  path.write_text("old")
  real_fdopen = os.fdopen

  class Full:  # a file whose writes fail as on a full disk
    def __init__(self, f):
      self.f = f
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      self.f.close()
    def write(self, data):
      raise _enospc()

  monkeypatch.setattr(os, "fdopen", lambda *a, **k: Full(real_fdopen(*a, **k)))
  with pytest.raises(errors.DiskFull, match=r"config.json.*needs about 3 "
                     r"bytes.*free"):
    atomic.write_text(str(path), "new")
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["config.json"]  # no temporary file left


def test_a_full_disk_at_start_up_leaves_no_lock_and_no_half_history(
    tmp_path, monkeypatch):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
  with monkeypatch.context() as m:
    WriteFaults(m, tmp_path, 1, _enospc)  # the lock's first write
    with pytest.raises(errors.DiskFull, match="lock"):
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
  workdir_lib.WorkdirLock(str(tmp_path)).acquire().release()
  with monkeypatch.context() as m:
    WriteFaults(m, tmp_path, 2, _enospc)  # history/: the second file copied
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(errors.DiskFull, match="history"):
      workdir_lib.set_aside_history(str(tmp_path), 0)
  assert os.listdir(tmp_path / "history") == []
  assert workdir_lib.set_aside_history(str(tmp_path), 0).endswith("history/1")


def test_a_full_disk_at_a_metrics_row_leaves_no_half_row(tmp_path,
                                                         monkeypatch):
  log = metrics_log.MetricsLog(str(tmp_path), total_steps=2, start_step=0)
  log.write(dict(step=0, loss=1.0))
  real_open = builtins.open

  def half_then_full(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    if "a" in mode:
      write = f.write
      def cut(text):
        write(text[:5])
        f.flush()
        raise _enospc()
      f.write = cut
    return f

  monkeypatch.setattr(builtins, "open", half_then_full)
  with pytest.raises(errors.DiskFull, match="metrics.jsonl"):
    log.write(dict(step=1, loss=0.5))
  monkeypatch.undo()
  assert (tmp_path / "metrics.jsonl").read_text() == (
      json.dumps(dict(step=0, loss=1.0)) + "\n")


# ---------------------------------------------------------------------------
# Export: into a temporary sibling, renamed into place when complete.


def _tree(path):
  """{relative path: bytes} of a folder (None if there is none)."""
  if not os.path.isdir(path):
    return None
  out = {}
  for directory, _, names in os.walk(path):
    for name in names:
      full = os.path.join(directory, name)
      with open(full, "rb") as f:
        out[os.path.relpath(full, path)] = f.read()
  return out


@pytest.mark.parametrize("previous", [False, True], ids=["fresh",
                                                         "re_export"])
def test_a_killed_export_keeps_the_previous_one(trained, tmp_path,
                                                monkeypatch, previous):
  out = tmp_path / "hf"
  if previous:
    export.export(str(trained), str(out), step=4)
  old = _tree(out)
  at = 1
  while True:
    with monkeypatch.context() as m:
      WriteFaults(m, tmp_path, at, Killed)
      try:
        export.export(str(trained), str(out), overwrite=True)
        break
      except Killed:
        pass
    assert _tree(out) == old, at  # the old export whole, or still none
    at += 1
  assert at > 3, at  # config.json, tokenizer files, the rename
  new = _tree(out)
  assert new != old and "model.safetensors" in new and "tokenizer.json" in new
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no .partial left


def test_export_refuses_a_file_or_an_export_without_overwrite(trained,
                                                              tmp_path):
  (tmp_path / "file").write_text("x")
  assert export.main(["export", str(trained), str(tmp_path / "file")]) == 2
  assert (tmp_path / "file").read_text() == "x"
  export.export(str(trained), str(tmp_path / "hf"))
  with pytest.raises(ValueError, match="--overwrite"):
    export.export(str(trained), str(tmp_path / "hf"))


def test_a_full_disk_during_export_keeps_the_previous_one(trained, tmp_path,
                                                          monkeypatch, capsys):
  out = tmp_path / "hf"
  export.export(str(trained), str(out), step=4)
  old = _tree(out)
  with monkeypatch.context() as m:
    WriteFaults(m, tmp_path, 1, _enospc)
    assert export.main(["export", str(trained), str(out), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert "no space left" in err and str(out) in err and "needs about" in err
  assert err.count("\n") == 1, err
  assert _tree(out) == old and sorted(os.listdir(tmp_path)) == ["hf"]


# ---------------------------------------------------------------------------
# The data a position belongs to.


def _text_corpus(path, n):
  os.makedirs(path, exist_ok=True)
  for i in range(n):
    (path / f"doc{i}.txt").write_text(f"Document {i}: flat is better. " * 20)


def _iterator(corpus):
  cfg = pipeline.data_config()
  cfg.source, cfg.path = "files", f"{corpus}/*.txt"
  cfg.val_path = cfg.path
  return pipeline.train_iterator(cfg, tokenizers.make_tokenizer("bytes"),
                                 seq_len=16, global_batch=2, seed=0)


def test_a_data_position_is_refused_for_changed_files(tmp_path):
  corpus = tmp_path / "corpus"
  _text_corpus(corpus, 10)
  it = _iterator(corpus)
  next(it)
  state = json.loads(json.dumps(it.get_state()))  # as in a checkpoint
  _iterator(corpus).set_state(state)  # the same files: fine
  for i in range(2, 10):
    os.remove(corpus / f"doc{i}.txt")
  (corpus / "doc1.txt").write_text("longer " * 100)
  (corpus / "new.txt").write_text("a new document " * 10)
  changed = _iterator(corpus)
  with pytest.raises(fingerprint.DataChanged) as e:
    changed.set_state(state)
  message = str(e.value)
  assert "8 of its 10 files gone ('doc2.txt', 'doc3.txt', 'doc4.txt', ...)" \
      in message, message
  assert "1 file new ('new.txt')" in message
  assert "1 file changed size ('doc1.txt': 560 -> 700 bytes)" in message
  changed.set_state(state, other_data=True)  # accepted when asked
  del state["data"]  # a checkpoint from before the fingerprint was kept
  changed.set_state(state)


# ---------------------------------------------------------------------------
# Runs that stopped learning.


def test_a_stall_is_found_once_after_a_window():
  uniform = stall.math.log(258)
  watch = stall.StallWatch(258, after_step=5, window=4)
  found = [watch.update(s, uniform, 1.0) for s in range(1, 10)]
  # Steps 1-5 are the warm-up; 6, 7, 8, 9 are the window.
  assert found[:8] == [None] * 8 and "steps 6-9" in found[8], found
  assert "ln(vocab_size) = 5.5530" in watch.found
  assert watch.update(10, uniform, 1.0) is None  # said once
  watch = stall.StallWatch(258, window=3)
  found = [watch.update(s, 3.0, g) for s, g in
           enumerate([0.0, 0.0, 0.5, 0.0, 0.0, 0.0], 1)]
  assert found[:5] == [None] * 5 and "gradient norm was exactly 0" in found[5]
  watch = stall.StallWatch(258, window=3)  # a learning run: nothing
  assert {watch.update(s, 5.0 - 0.1 * s, 1.0) for s in range(1, 50)} == {None}


# ---------------------------------------------------------------------------
# The resume check reads the config the checkpoint carries.


def _resolved(n_layers=1, recipe="bf16"):
  quant = recipes.config_template(recipe)
  return dict(model=dict(n_layers=n_layers, dim=64),
              recipe=train_config.resolve_recipe(quant, "float32").to_config().to_dict())


def _checkpointed(workdir, saved, step=4):
  """A committed checkpoint directory whose JSON item carries `saved`."""
  os.makedirs(workdir / "checkpoints" / str(step) / "state")
  os.makedirs(workdir / "checkpoints" / str(step) / "data")
  (workdir / "checkpoints" / str(step) / "data" / "metadata").write_text(
      json.dumps({"processes": [], "config": saved}))


def test_the_resume_check_needs_no_config_json(tmp_path):
  saved = dict(tiny_config().to_dict(), resolved=_resolved())
  _checkpointed(tmp_path, saved)
  for config_json in (None, "[]", '{"steps": 3}', "{"):
    if config_json is not None:
      (tmp_path / "config.json").write_text(config_json)
    with pytest.raises(errors.UserError, match=r"from its checkpoint: "
                       r"quant.name: 'bf16' -> 'fp8'"):
      workdir_lib.check_resume_config(str(tmp_path),
                                      tiny_config(**{"quant.name": "fp8"}),
                                      _resolved(recipe="fp8"))
    assert workdir_lib.check_resume_config(str(tmp_path), tiny_config(steps=9),
                                           _resolved()) == []


def test_the_resume_check_shows_the_values_in_effect(tmp_path):
  """model.n_layers None is the preset's value (1 here): giving 1 changes
  nothing, giving 3 is refused as 1 -> 3, not None -> 3."""
  saved = tiny_config()
  saved.model.n_layers = None
  _checkpointed(tmp_path, dict(saved.to_dict(), resolved=_resolved(1)))
  assert workdir_lib.check_resume_config(
      str(tmp_path), tiny_config(), _resolved(1)) == []
  config = tiny_config()
  config.model.n_layers = 3
  with pytest.raises(errors.UserError, match=r"model.n_layers: 1 -> 3\)"):
    workdir_lib.check_resume_config(str(tmp_path), config, _resolved(3))
  assert workdir_lib.check_resume_config(
      str(tmp_path), config, _resolved(3), override=True) == ["model.n_layers"]
  note = json.loads((tmp_path / "history" / "1" / "resume_override.json")
                    .read_text())
  assert note["override_resume"] == [dict(key="model.n_layers", was=1, now=3)]


def test_an_old_checkpoint_without_a_usable_config_json_is_refused(tmp_path):
  _checkpointed(tmp_path, None)  # written before checkpoints carried it
  (tmp_path / "config.json").write_text("[]")
  with pytest.raises(errors.UserError, match=r"config.json is not a config "
                     r"written by fp4jax's trainer \(it holds a list\).*"
                     "--override_resume"):
    workdir_lib.check_resume_config(str(tmp_path), tiny_config(), _resolved())
  assert workdir_lib.check_resume_config(str(tmp_path), tiny_config(),
                                         _resolved(), override=True) == []


# ---------------------------------------------------------------------------
# The trainer: changed data, a lost config.json, a full disk, a stall.


def _files_config(corpus, **overrides):
  config = tiny_config(**STEPS, **overrides)
  config.data.source, config.data.path = "files", f"{corpus}/*.txt"
  config.data.val_path = config.data.path
  return config


def test_a_corpus_changed_between_stop_and_resume(tmp_path, trained):
  """The rerun is refused naming the vanished files; --override_resume
  continues on the files left and records that in history/."""
  del trained  # compiled the programs these runs share
  corpus, workdir = tmp_path / "corpus", tmp_path / "run"
  _text_corpus(corpus, 10)
  trainer.train(_files_config(corpus), str(workdir))
  shutil.rmtree(workdir / "checkpoints" / "8")  # as if stopped at step 4
  for i in range(3, 10):
    os.remove(corpus / f"doc{i}.txt")
  with pytest.raises(errors.UserError, match=r"the training data changed "
                     r"since the checkpoint at step 4.*7 of its 10 files gone "
                     r"\('doc3.txt'.*--override_resume"):
    trainer.train(_files_config(corpus), str(workdir))
  summary = trainer.train(_files_config(corpus), str(workdir),
                          override_resume=True)
  assert summary["step"] == 8 and summary["resumed_from_step"] == 4
  notes = [json.loads(p.read_text()) for p in
           (workdir / "history").glob("*/resume_override.json")]
  assert [n["data"] for n in notes] == [
      "7 of its 10 files gone ('doc3.txt', 'doc4.txt', 'doc5.txt', ...)"]
  assert notes[0]["validation_data"] == notes[0]["data"]  # val_path: the same files


def test_without_config_json_another_recipe_is_refused(tmp_path, trained):
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  os.remove(workdir / "config.json")
  with pytest.raises(errors.UserError, match=r"from its checkpoint: "
                     r"quant.name: 'bf16' -> 'fp8'"):
    trainer.train(tiny_config(**STEPS, **{"quant.name": "fp8"}), str(workdir))
  assert not (workdir / "lock").exists()


class _SaveFails:
  """orbax's write of a checkpoint's JSON item fails with ENOSPC (in the
  background for asynchronous saves); `failed` is set when it has."""

  def __init__(self, monkeypatch):
    self.failed = threading.Event()

    async def save_fn(handler, x, directory):
      del handler, x
      self.failed.set()
      raise OSError(errno.ENOSPC, "No space left on device",
                    str(directory / "metadata"))

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_at_a_checkpoint_trains_no_further_step(
    tmp_path, trained, monkeypatch, async_save):
  """The save of step 4 fails: DiskFull names the checkpoint directory, and
  no step starts once the failure is known (async: at the latest, the
  callback of step 5 waits for it, so step 6 would be the first after it)."""
  del trained
  fails = _SaveFails(monkeypatch)
  trained_steps = []

  def callback(step, state, batch):
    del state, batch
    trained_steps.append(step)
    if step == 5 and async_save:
      assert fails.failed.wait(60)
      time.sleep(1.0)  # the background thread records its error

  with pytest.raises(errors.DiskFull, match=r"no space left on the disk of "
                     r".*checkpoints'.*needs about"):
    trainer.train(tiny_config(async_checkpointing=async_save),
                  str(tmp_path / "run"), callbacks=[callback])
  assert trained_steps in ([1, 2, 3, 4], [1, 2, 3, 4, 5][:5 if async_save
                                                         else 4])
  assert not (tmp_path / "run" / "lock").exists()
  assert checkpointing.committed_steps(tmp_path / "run" / "checkpoints") == []


def test_a_run_that_stopped_learning_says_so(tmp_path, trained, monkeypatch,
                                             capsys):
  del trained
  monkeypatch.setattr(stall, "WINDOW", 3)
  monkeypatch.setattr(stall, "TOLERANCE", 100.0)  # every loss is "uniform"
  summary = trainer.train(tiny_config(**STEPS), str(tmp_path / "run"))
  assert summary["status"] == "stalled", summary
  assert "stopped learning" in summary["message"] and "steps 3-5" in (
      summary["message"])  # warm-up: 2 steps
  assert json.loads((tmp_path / "run" / "summary.json").read_text())[
      "status"] == "stalled"
  assert capsys.readouterr().err.count("warning: the run stopped learning") == 1


def test_a_workdir_that_is_a_dangling_symlink_is_named(tmp_path):
  os.symlink(tmp_path / "gone", tmp_path / "run")
  with pytest.raises(errors.UserError, match=r"symbolic link to '.*gone', "
                     "which does not exist"):
    workdir_lib.prepare(str(tmp_path / "run"))


def test_a_run_records_its_tokenizer_with_the_checkpoint(trained):
  """What the resume and export checks compare (tokenizers.identity)."""
  saved = run_layout.checkpoint_config(str(trained))
  assert saved["resolved"]["tokenizer"] == dict(path="bytes", sha256=None)
  assert json.loads((trained / "config.json").read_text())["resolved"]["tokenizer"] == (
      saved["resolved"]["tokenizer"])


def test_tokens_only_grow_across_a_seq_len_override(trained, tmp_path):
  """Resumed at step 8 with seq_len 16 (from 32), then at 12 with 8: every
  reported token count continues from the one before (the second from the
  count its checkpoint kept)."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  trainer.train(tiny_config(**STEPS, steps=12, seq_len=16, checkpoint_every=2),
                str(workdir), override_resume=True)
  summary = trainer.train(tiny_config(**STEPS, steps=14, seq_len=8), str(workdir),
                          override_resume=True)
  rows = read_metrics(str(workdir))
  tokens = [r["tokens"] for r in rows]
  assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
  expected = 8 * 8 * 32 + 4 * 8 * 16 + 2 * 8 * 8
  assert tokens[-1] == summary["tokens"] == expected


@pytest.mark.parametrize("damage", [("_CHECKPOINT_METADATA", "[]"),
                                    ("data/metadata", '{"processes": 3}')],
                         ids=["orbax_metadata", "data_metadata"])
def test_a_checkpoint_with_unusable_metadata_is_set_aside(trained, tmp_path, caplog,
                                                          damage):
  """The newest checkpoint's metadata of the wrong shape: it is moved to
  checkpoints_corrupt/ naming the file, and the run resumes from the one
  before (every later resume too)."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  name, text = damage
  (workdir / "checkpoints" / "8" / name).write_text(text)
  summary = trainer.train(tiny_config(**STEPS), str(workdir))
  assert summary["resumed_from_step"] == 4 and summary["step"] == 8
  assert os.listdir(workdir / "checkpoints_corrupt") == ["8"]
  assert f"8/{name}" in caplog.text and "falling back" in caplog.text


def test_a_truncated_newest_checkpoint_is_named_and_the_one_before_used(
    trained, tmp_path, capfd):
  """Array data of step 8 cut in half: export and init_from name step 8 and
  use step 4 (saying so); export --step 8 is one line naming it."""
  run = tmp_path / "run"
  shutil.copytree(trained, run)
  arrays = run / "checkpoints" / "8" / "state" / "ocdbt.process_0" / "d"
  for name in os.listdir(arrays):
    with open(arrays / name, "r+b") as f:
      f.truncate(os.path.getsize(arrays / name) // 2)
  lines = export.export(str(run), str(tmp_path / "hf"))
  assert f"step 4 of {run}" in lines[0], lines
  err = capfd.readouterr().err
  assert re.search(r"the checkpoint at step 8 \(.*\) in .* cannot be read; using step 4, "
                   "the newest readable one", err), err
  assert "Traceback" not in err
  with pytest.raises(errors.UserError, match=r"^the checkpoint at step 8 \(.*\) in .* cannot "
                     r"be read; its other checkpoints: \[4\]$"):
    export.export(str(run), str(tmp_path / "hf8"), step=8)
  summary = trainer.train(tiny_config(**STEPS, init_from=str(run)),  # trained's programs
                          str(tmp_path / "from_run"))
  assert summary["status"] == "completed"
  assert "cannot be read; using step 4" in capfd.readouterr().err


def test_init_from_weights_with_nan_is_refused_naming_them(trained, tmp_path):
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  hf_dir = tmp_path / "hf"
  export.export(str(trained), str(hf_dir))
  weights = safetensors.numpy.load_file(str(hf_dir / "model.safetensors"))
  weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
  safetensors.numpy.save_file(weights, str(hf_dir / "model.safetensors"),
                              metadata={"format": "pt"})
  with pytest.raises(errors.UserError, match=r"^bad config: config.init_from: .* holds NaN or "
                     r"Inf in 1 tensor\(s\): block_0/mlp/down/kernel; give"):
    trainer.train(tiny_config(**STEPS, steps=1, init_from=str(hf_dir)), str(tmp_path / "run"))


def test_a_symlinked_metrics_file_stays_a_link(trained, tmp_path):
  """A resume that rewrites metrics.jsonl (rows after its checkpoint are
  dropped) writes the file the link points to."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  target = tmp_path / "elsewhere.jsonl"
  shutil.move(str(workdir / "metrics.jsonl"), str(target))
  os.symlink(str(target), str(workdir / "metrics.jsonl"))
  shutil.rmtree(workdir / "checkpoints" / "8")  # resumes at 4: rows 5-8 dropped, then again
  trainer.train(tiny_config(**STEPS), str(workdir))
  assert os.path.islink(workdir / "metrics.jsonl")
  steps = [json.loads(line)["step"] for line in target.read_text().splitlines()]
  assert steps == list(range(9)), steps


def _word_tokenizer(directory, vocab):
  """A tiny Hugging Face tokenizer.json (WordLevel) with `vocab` in that order."""
  os.makedirs(directory)
  (directory / "tokenizer.json").write_text(json.dumps({
      "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
      "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
      "decoder": None, "model": {"type": "WordLevel", "unk_token": "a",
                                 "vocab": {w: i for i, w in enumerate(vocab)}}}))


def test_a_resume_from_another_directory_with_another_tokenizer_is_refused(
    tmp_path, monkeypatch, trained):
  """data.tokenizer "tok" is read from the current directory: the run started
  in a/ may not resume from b/, whose "tok" is another tokenizer."""
  del trained  # compiled the programs of its model, which these runs share
  _word_tokenizer(tmp_path / "a" / "tok", ["<s>", "</s>", "a", "def", "return"])
  _word_tokenizer(tmp_path / "b" / "tok", ["<s>", "</s>", "a", "return", "def"])
  config = tiny_config(**STEPS)
  config.data.tokenizer = "tok"
  config.model.vocab_size = tokenizers.make_tokenizer("bytes").vocab_size  # trained's
  monkeypatch.chdir(tmp_path / "a")
  trainer.train(config, str(tmp_path / "run"))
  monkeypatch.chdir(tmp_path / "b")
  config.steps = 12
  with pytest.raises(errors.UserError, match=r"data.tokenizer: '.*/a/tok/tokenizer.json "
                     r"\(sha256 \w+\)' -> '.*/b/tok/tokenizer.json"):
    trainer.train(config, str(tmp_path / "run"))


# ---------------------------------------------------------------------------
# What a run reads back: its summary, its checkpoints' numbers, its data.


def test_a_finished_run_trained_further_and_killed_claims_no_finish(trained,
                                                                    tmp_path):
  """The finished 8-step run resumed with steps=12 and killed at step 10:
  no summary.json says it completed at step 8 (the report counts it
  unfinished, the ablation runner resumes it), and the rerun writes one."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  assert run_layout.read_summary(str(workdir))["status"] == "completed"

  def kill(step, state, batch):
    del state, batch
    if step == 10:
      raise Killed()

  with pytest.raises(Killed):
    trainer.train(tiny_config(**STEPS, steps=12), str(workdir), callbacks=[kill])
  assert run_layout.read_summary(str(workdir)) is None
  assert not report.load_run(str(workdir), "bf16", None).finished
  summary = trainer.train(tiny_config(**STEPS, steps=12), str(workdir))
  assert (summary["status"], summary["step"]) == ("completed", 12)
  assert run_layout.read_summary(str(workdir))["step"] == 12


def _plant_nan(state_dir, leaf):
  """Writes NaN into the first element of `leaf` (named as
  checkpointing.leaf_name names it) of the checkpoint item `state_dir`."""
  checkpointer = ocp.StandardCheckpointer()
  state = jax.tree.map(np.array, checkpointer.restore(state_dir))
  *path, last = leaf.split("/")
  node = state
  for key in path:
    node = node[int(key) if isinstance(node, list) else key]
  node[last].flat[0] = np.nan
  planted = f"{state_dir}.planted"
  checkpointer.save(planted, state)
  checkpointer.wait_until_finished()
  checkpointer.close()
  shutil.rmtree(state_dir)
  os.rename(planted, state_dir)


@pytest.mark.parametrize("leaf", ["params/block_0/mlp/down/kernel",
                                  "opt_state/1/0/nu/head/kernel"],
                         ids=["params", "adam_nu"])
def test_a_checkpoint_holding_nan_is_set_aside_and_the_one_before_used(
    trained, tmp_path, caplog, leaf):
  """NaN in the newest checkpoint's parameters or Adam state: it is moved to
  checkpoints_corrupt/ naming the tensor, the run resumes from step 4, and
  trains on with finite losses to a finite checkpoint."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  _plant_nan(workdir / "checkpoints" / "8" / "state", leaf)
  summary = trainer.train(tiny_config(**STEPS, steps=12), str(workdir))
  assert summary["resumed_from_step"] == 4, summary
  assert (summary["status"], summary["skipped_steps"]) == ("completed", 0)
  assert os.listdir(workdir / "checkpoints_corrupt") == ["8"]
  assert ("Checkpoint at step 8 cannot be used (its state holds NaN or Inf in "
          f"1 tensor(s): {leaf})") in caplog.text
  assert all(math.isfinite(r["loss"]) for r in read_metrics(str(workdir))
             if "loss" in r)
  step, state = final_state(str(workdir))
  assert step == 12 and checkpointing.non_finite(state) == ""


def test_a_run_reads_the_data_it_recorded_from_any_directory(
    tmp_path, monkeypatch, trained):
  """A run trained in a/ on data.path 'data/*.txt' and data.val_path
  'val/*.txt': from b/, whose val/ holds other text, its W4A4 export
  calibrates on a/'s files (the input scales of an export from a/) and a
  resume is refused naming the validation files; once a/'s validation files
  change, the export is refused in one line."""
  import safetensors  # pylint: disable=import-outside-toplevel
  del trained  # compiled the programs of its model, which these runs share
  for folder, text in (("a", "flat is better than nested. "),
                       ("b", "0 1 2 3 4 5 6 7 8 9 ")):
    _text_corpus(tmp_path / folder / "data", 6)  # the same training files
    os.makedirs(tmp_path / folder / "val")
    for i in range(3):
      (tmp_path / folder / "val" / f"v{i}.txt").write_text(
          f"Held out {i}: {text}" * (20 + 7 * i))
  config = tiny_config(**STEPS)
  config.data.source, config.data.path = "files", "data/*.txt"
  config.data.val_path = "val/*.txt"
  run, w4a4 = str(tmp_path / "run"), dict(quantize="nvfp4", activations="fp4")
  monkeypatch.chdir(tmp_path / "a")
  trainer.train(config, run)
  export.export(run, str(tmp_path / "from_a"), **w4a4)
  monkeypatch.chdir(tmp_path / "b")
  export.export(run, str(tmp_path / "from_b"), **w4a4)
  scales = []
  for out in ("from_a", "from_b"):  # float32 scales (the weights are FP8, FP4)
    with safetensors.safe_open(str(tmp_path / out / "model.safetensors"),
                               "numpy") as f:
      scales.append({k: f.get_tensor(k) for k in f.keys()
                     if k.endswith("input_global_scale")})
  assert scales[0] and scales[0].keys() == scales[1].keys()
  for name, scale in scales[0].items():
    np.testing.assert_array_equal(scales[1][name], scale, err_msg=name)
  config.steps = 12
  with pytest.raises(errors.UserError, match=r"^the validation data changed "
                     r"since the checkpoint at step 8 was saved: 3 files "
                     r"changed size \('v0.txt'.*--override_resume"):
    trainer.train(config, run)
  (tmp_path / "a" / "val" / "v1.txt").write_text("Held out 1: changed")
  with pytest.raises(errors.UserError, match=r"^calibration: the run's "
                     r"validation files changed since it was trained \(data.path "
                     r"'.*/a/data/\*.txt', data.val_path '.*/a/val/\*.txt': 1 "
                     r"file changed size \('v1.txt'.*export without "
                     r"--activations fp4"):
    export.export(run, str(tmp_path / "from_b2"), **w4a4)
