"""The training program on a very small Llama (8 virtual CPU devices, conftest).

Runs that several tests read are made once per module (fixtures), and each
run is a few steps of a one-layer model, so the file stays within its time
budget on a 2-core machine.
"""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

import jax
import numpy as np
from orbax.checkpoint._src import asyncio_utils
import pytest
import tensorstore as ts

from fp4jax import checkpointing
from fp4jax.backends import xla
from fp4jax.experiments import ablation
from fp4jax.train import cli
from fp4jax.train import config as train_config
from fp4jax.train import step as train_step
from fp4jax.train import trainer
from fp4jax.train import workdir as workdir_lib
from fp4jax.train.metrics_log import read_metrics
from tests.helpers import final_state, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("bf16"))
  summary = trainer.train(tiny_config(), workdir)
  return workdir, summary


# ------------------------------------------------------------- learning


@pytest.mark.slow
def test_bf16_run_lowers_loss_and_writes_its_outputs(bf16_run):
  workdir, summary = bf16_run
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(9))
  evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
  assert len(evals) == 3                        # steps 0, 4, 8
  assert evals[-1] < evals[0] - 0.5, evals
  assert rows[-1]["loss"] < rows[1]["loss"] - 0.5
  for key in ("step", "tokens", "loss", "eval_loss", "lr", "grad_norm",
              "step_time_s", "tokens_per_s", "skipped_steps"):
    assert key in rows[-1], key
  assert rows[-1]["tokens"] == 8 * 8 * 32
  assert summary["status"] == "completed"
  assert summary["final_eval_loss"] == evals[-1]
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["tokens"] == summary["tokens"]
  with open(os.path.join(workdir, "config.json")) as f:
    resolved = json.load(f)
  assert resolved["model"]["n_layers"] == 1
  assert resolved["resolved"]["model"]["vocab_size"] == 288  # the tokenizer's
  assert resolved["resolved"]["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
  assert resolved["resolved"]["xla_bf16_gemm"] == xla.bf16_gemm()._asdict()
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "8"]


@pytest.mark.slow
def test_mxfp4_dh16_lowers_loss_with_gradient_accumulation(tmp_path):
  summary = trainer.train(
      tiny_config(**{"quant.name": "mxfp4-dh16", "micro_batch": 8,
                     "batch_size": 16, "steps": 6, "eval_every": 6}),
      str(tmp_path))
  rows = read_metrics(str(tmp_path))
  assert summary["recipe"] == "mxfp4-dh16"
  assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.5, rows
  assert rows[-1]["tokens"] == 6 * 16 * 32


def test_schedule_warms_up_then_decays_to_min_ratio():
  config = tiny_config(steps=100, warmup_steps=10, lr=1.0)
  schedule = train_step.lr_schedule(config)
  assert float(schedule(0)) == 0.0
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(100)) == pytest.approx(0.1)
  assert 0.1 < float(schedule(55)) < 1.0


# ------------------------------------------------------------- resume


_KILLED_CHILD = """
import json, os, signal, sys
import ml_collections
from fp4jax.train import step as train_step
from fp4jax.train import trainer
config = ml_collections.ConfigDict(json.loads(sys.argv[1]))
def kill(step, state, batch):
  if step == int(sys.argv[3]):
    os.kill(os.getpid(), signal.SIGKILL)
trainer.train(config, sys.argv[2], callbacks=[kill])
"""


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_equal_to_an_uninterrupted_run(
    bf16_run, tmp_path):
  reference, _ = bf16_run
  workdir = str(tmp_path)
  # Synchronous saves, so that the checkpoint at step 4 is surely committed
  # when SIGKILL comes in step 6's callback (before its row is written);
  # steps 5 and 6 are lost. (The other runs here save asynchronously.)
  config = tiny_config(async_checkpointing=False)
  child = subprocess.run(
      [sys.executable, "-c", _KILLED_CHILD, config.to_json(), workdir, "6"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  assert [r["step"] for r in read_metrics(workdir)][-1] == 5
  summary = trainer.train(config, workdir)
  assert summary["resumed_from_step"] == 4
  assert summary["step"] == 8
  step_a, state_a = final_state(reference)
  step_b, state_b = final_state(workdir)
  assert step_a == step_b == 8
  leaves_a, tree_a = jax.tree.flatten(state_a)
  leaves_b, tree_b = jax.tree.flatten(state_b)
  assert tree_a == tree_b
  for a, b in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(a, b)
  # metrics.jsonl holds one history: the killed run's steps 5-6 were dropped.
  steps = [r["step"] for r in read_metrics(workdir)]
  assert steps == list(range(9))
  losses = [r["loss"] for r in read_metrics(workdir) if "loss" in r]
  assert losses == [r["loss"] for r in read_metrics(reference) if "loss" in r]


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(tmp_path, caplog):
  directory = str(tmp_path / "checkpoints")
  ckpts = checkpointing.Checkpoints(directory, keep=3, async_save=False,
                                    set_aside_to=str(tmp_path / "checkpoints_corrupt"))
  state = {"w": np.arange(6, dtype=np.float32), "step": np.int32(0)}
  for step in (1, 2):
    ckpts.save(step, {"w": state["w"] * step, "step": np.int32(step)},
               {"rows": [step]})
  ckpts.wait()
  for root, _, names in os.walk(os.path.join(directory, "2", "state")):
    for name in names:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(max(os.path.getsize(f.name) // 2 - 1, 0))
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  with caplog.at_level(logging.WARNING):
    step, restored, data_state = ckpts.restore_latest(abstract)
  assert step == 1 and data_state == {"rows": [1]}
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert "step 2 could not be read" in caplog.text
  assert ckpts.steps() == [1]
  assert os.path.isdir(tmp_path / "checkpoints_corrupt" / "2")
  # With every checkpoint unreadable there is nothing to resume from.
  os.remove(os.path.join(directory, "1", "data", "metadata"))
  assert ckpts.restore_latest(abstract) is None
  ckpts.close()


def test_a_checkpoint_of_other_array_names_is_refused_and_left_in_place(
    tmp_path):
  """A readable checkpoint whose arrays have the shapes asked under other
  names: CheckpointMismatch naming them; it stays in checkpoints/."""
  ckpts = checkpointing.Checkpoints(str(tmp_path / "checkpoints"), keep=3,
                                    async_save=False,
                                    set_aside_to=str(tmp_path / "corrupt"))
  ckpts.save(1, {"params": {"a": np.ones(4, np.float32)}}, {"rows": [1]})
  ckpts.wait()
  abstract = {"params": {"b": jax.ShapeDtypeStruct((4,), np.float32)}}
  with pytest.raises(checkpointing.CheckpointMismatch, match=r"^the checkpoint "
                     r"at step 1 in .* does not fit this config \(1 arrays are "
                     r"not in it, e.g. params/b; 1 arrays of it are not asked, "
                     r"e.g. params/a\); it is readable and was left in place"):
    ckpts.restore_latest(abstract)
  assert ckpts.steps() == [1] and not os.path.exists(tmp_path / "corrupt")
  ckpts.close()


def _damage(step_dir, kind):
  """Damages one part of a saved checkpoint directory."""
  if kind == "array files removed":
    arrays = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
    for name in os.listdir(arrays):
      os.remove(os.path.join(arrays, name))
    return
  name = {"state metadata cut": "state/_METADATA",
          "step metadata garbage": "_CHECKPOINT_METADATA"}[kind]
  path = os.path.join(step_dir, name)
  if kind.endswith("garbage"):
    with open(path, "w") as f:
      f.write("\x00not json{")
  else:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("kind, restored_step", [
    ("array files removed", 1), ("state metadata cut", 1),
    # Only orbax's record of the step (times, custom metadata): the arrays
    # and the data state are whole, so the checkpoint is used.
    ("step metadata garbage", 2)])
# tensorstore reports a read that ends on a closed loop as "unraisable".
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_each_kind_of_damage_restores_without_a_traceback(
    tmp_path, capfd, kind, restored_step):
  directory = str(tmp_path / "checkpoints")
  ckpts = checkpointing.Checkpoints(directory, keep=3, async_save=False,
                                    set_aside_to=str(tmp_path / "checkpoints_corrupt"))
  rng = np.random.default_rng(0)  # random: too big to be inlined in OCDBT
  state = {f"w{i}": rng.standard_normal((64, 32), np.float32)
           for i in range(6)}
  for step in (1, 2):
    ckpts.save(step, jax.tree.map(lambda x, s=step: x * s, state),
               {"rows": [step]})
  ckpts.wait()
  _damage(os.path.join(directory, "2"), kind)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  step, restored, data_state = ckpts.restore_latest(abstract)
  ckpts.close()
  assert step == restored_step and data_state == {"rows": [step]}
  np.testing.assert_array_equal(restored["w3"], state["w3"] * step)
  out = "".join(capfd.readouterr())
  assert "Traceback" not in out and "Event loop is closed" not in out, out
  assert os.path.isdir(tmp_path / "checkpoints_corrupt" / "2") == (step == 1)


def _late_read_errors(restore_from_orbax):
  """Errors printed when a read ends after orbax's restore raised.

  `restore_from_orbax(coro)` runs coro as orbax runs a restore. The restore
  gathers a read still waiting on a tensorstore future and one that fails;
  the waiting read ends only after the restore has returned. Returns the
  reprs of the errors tensorstore reported (sys.unraisablehook).
  """
  promise, pending = ts.Promise.new()

  async def read_still_running():
    await pending

  async def read_that_fails():
    raise OSError("unreadable chunk")

  async def restore():
    await asyncio.gather(read_still_running(), read_that_fails())

  seen, hook = [], sys.unraisablehook
  sys.unraisablehook = seen.append
  try:
    with pytest.raises(OSError, match="unreadable chunk"):
      restore_from_orbax(restore())
    promise.set_result(0)
  finally:
    sys.unraisablehook = hook
  return [repr(u.exc_value) for u in seen]


def test_a_failed_restore_stops_its_other_reads():
  """Deterministic form of the "Event loop is closed" tracebacks that a
  corrupt checkpoint printed in most fallbacks (orbax 0.12 closes its loop
  with the other reads still running)."""
  # The control: orbax alone reports the late read on its closed loop.
  assert _late_read_errors(asyncio_utils.run_sync) == [
      "RuntimeError('Event loop is closed')"]

  def stopped(coro):
    with checkpointing._failed_reads_stopped():
      return asyncio_utils.run_sync(coro)

  assert _late_read_errors(stopped) == []
  # Only wrapped within the block; a coroutine that succeeds is unchanged.
  assert asyncio_utils.run_sync.__module__ == asyncio_utils.__name__

  async def fine():
    return 7

  assert stopped(fine()) == 7


def test_a_failed_restore_leaves_its_loop_open_for_late_callbacks():
  """A read already inside tensorstore's threads cannot be cancelled; when it
  ends after the failed restore, its callback reaches the restore's loop,
  which must still be open (orbax alone has closed it: RuntimeError)."""
  def failed_restore_loop(run_sync):
    loops = []

    async def restore():
      loops.append(asyncio.get_running_loop())
      raise OSError("unreadable chunk")

    with pytest.raises(OSError, match="unreadable chunk"):
      run_sync(restore())
    return loops[0]

  with pytest.raises(RuntimeError, match="Event loop is closed"):
    failed_restore_loop(asyncio_utils.run_sync).call_soon_threadsafe(lambda: None)
  with checkpointing._failed_reads_stopped():
    loop = failed_restore_loop(asyncio_utils.run_sync)
  loop.call_soon_threadsafe(lambda: None)  # queued, never run: no error
  assert not loop.is_closed()


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_stops_then_the_run_resumes(
    bf16_run, tmp_path):
  workdir = str(tmp_path)

  def terminate(step, state, batch):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)

  summary = trainer.train(tiny_config(), workdir, callbacks=[terminate])
  assert summary["status"] == "interrupted" and summary["step"] == 3
  assert "SIGTERM" in summary["message"]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
  summary = trainer.train(tiny_config(), workdir)
  assert summary["resumed_from_step"] == 3 and summary["status"] == "completed"
  reference, _ = bf16_run
  for a, b in zip(jax.tree.leaves(final_state(reference)[1]),
                  jax.tree.leaves(final_state(workdir)[1])):
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------- stopping


@pytest.mark.slow
def test_non_finite_steps_are_skipped_and_counted(tmp_path):
  checksums = {}

  def record(step, state, batch):
    leaves = jax.tree.leaves(state.params)
    checksums[step] = [np.asarray(x).copy() for x in leaves]
    return {"probe": step}

  summary = trainer.train(
      tiny_config(max_bad_steps=3), str(tmp_path), callbacks=[record],
      nan_steps=(3, 4))
  rows = read_metrics(str(tmp_path))
  assert summary["status"] == "completed" and summary["skipped_steps"] == 2
  assert [r["skipped_steps"] for r in rows if r["step"]] == [0, 0, 1, 2, 2, 2,
                                                             2, 2]
  assert np.isnan(rows[3]["loss"]) and np.isfinite(rows[5]["loss"])
  assert all(r["probe"] == r["step"] for r in rows if r["step"])
  for a, b in zip(checksums[2], checksums[4]):   # 3 and 4 not applied
    np.testing.assert_array_equal(a, b)
  assert not all(np.array_equal(a, b)
                 for a, b in zip(checksums[4], checksums[5]))


@pytest.mark.slow
def test_too_many_bad_steps_stop_the_run_keeping_the_good_checkpoint(
    tmp_path):
  # Same program as the test above (compiled once): only max_bad_steps differs.
  summary = trainer.train(
      tiny_config(max_bad_steps=2, checkpoint_every=1), str(tmp_path),
      nan_steps=(3, 4))
  assert summary["status"] == "diverged"
  assert summary["step"] == 4
  assert "2 steps in a row" in summary["message"]
  steps = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
  assert steps[-1] == 2


@pytest.mark.slow
def test_target_eval_loss_stops_the_run_and_records_tokens(tmp_path):
  summary = trainer.train(tiny_config(target_eval_loss=100.0, eval_every=2),
                          str(tmp_path))
  assert summary["status"] == "target_reached"
  assert summary["step"] == 2
  assert summary["target_tokens"] == 2 * 8 * 32
  assert read_metrics(str(tmp_path))[-1]["target_reached"] is True


def test_a_committed_workdir_still_passes_the_resume_check(tmp_path):
  """results/'s config.json files hold keys fp4jax has since dropped (the
  test hook nan_steps): rerunning their config must still resume them."""
  saved = json.load(open(os.path.join(
      ROOT, "results", "ablation_tiny", "bf16_seed0", "config.json")))
  assert "nan_steps" in saved
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = ablation.run_config(
      cli.load_config_file(os.path.join(ROOT, "configs", "ablation_tiny.py")),
      "bf16", seed=0)
  assert "nan_steps" not in config
  # The same config resolves to the same model and recipe as saved.
  assert workdir_lib.check_resume_config(str(tmp_path), config,
                                         saved["resolved"]) == []


# ------------------------------------------------------------- bad config


@pytest.mark.parametrize("key,value,words", [
    ("model.name", "gpt-17", "unknown model preset 'gpt-17'"),
    ("quant.name", "mxfp5", "unknown recipe 'mxfp5'"),
    ("data.source", "nowhere", "unknown data.source 'nowhere'"),
    ("data.path", "/no/such/dir/*.json.gz", "matches no files"),
    ("data.tokenizer", "/no/such/tokenizer.json", "tokenizer"),
    ("micro_batch", 3, "micro_batch 3 must divide batch_size 8"),
    ("eval_batch_size", 4, "eval batch size 4 (config.eval_batch_size; 0 = micro_batch) "
     "is not divisible by the 8 batch shards"),
    ("dtype", "float16", "dtype 'float16'"),
])
def test_bad_config_values_fail_at_start_with_a_clear_message(
    tmp_path, key, value, words):
  config = tiny_config()
  if key.startswith("data.path"):
    config.data.source = "files"
  section, _, name = key.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(train_config.ConfigError) as err:
    trainer.train(config, str(tmp_path))
  assert words in str(err.value)
  assert not os.path.exists(tmp_path / "checkpoints")
