"""fp4jax.evaluate: the run's own eval_loss again, a NumPy reference, exports, bad input.

One tiny run (one layer, mxfp4, four steps, evaluated at steps 2 and 4 on
three batches) is trained once for the module, on one device.
"""

import json
import os
import shutil

import numpy as np
import pytest

from fp4jax import evaluate
from fp4jax import trained
from fp4jax.data import pipeline
from fp4jax.llama import hf as hf_llama
from fp4jax.train import export
from fp4jax.train import metrics_log
from fp4jax.train import trainer
from sharded_runs import on_first_devices
from tests.helpers import main_in_process, numpy_llama, refused, tiny_config

STEPS = 4
TEXT = "".join(f"def f{i}(x):\n  return x * {i} + {i * i}\n\n" for i in range(200))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("run"))
  with on_first_devices(1):
    trainer.train(tiny_config(**{"quant.name": "mxfp4", "steps": STEPS, "eval_every": 2,
                                 "checkpoint_every": 2, "eval_batches": 3,
                                 "async_checkpointing": False}), run_dir)
  return run_dir


@pytest.fixture(scope="module")
def text_glob(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "held_out.txt"
  path.write_text(TEXT)
  return str(path)


def _evaluate(*argv):
  rc, out = main_in_process(evaluate.main, [*argv, "--json"])
  assert rc == 0, out
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("step", [2, 4])
def test_it_gives_the_eval_loss_the_run_logged_bit_for_bit(run, step):
  logged = [r for r in metrics_log.read_metrics(run) if r["step"] == step][-1]
  # --step on the run, and the checkpoint's own folder.
  for argv in ([run, "--step", str(step)], [os.path.join(run, "checkpoints", str(step))]):
    got = _evaluate(*argv)
    assert got["step"] == step and got["recipe"].startswith("mxfp4")
    for key in ("eval_loss", "eval_loss_se", "eval_batch_losses"):
      assert got[key] == logged[key], key
    assert got["logged_eval_loss"] == logged["eval_loss"], got
    assert got["perplexity"] == pytest.approx(np.exp(logged["eval_loss"]), rel=1e-12)


def test_the_lines_say_the_logged_loss_is_the_same(run):
  rc, out = main_in_process(evaluate.main, [run])
  assert rc == 0, out
  assert f"step {STEPS} of {run}, forward mxfp4" in out
  assert "(standard error over 3 batches)" in out
  assert f"at step {STEPS} in metrics.jsonl (the same bits)" in out


def _cross_entropy(logits, targets):
  logits = logits - logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, targets[..., None], -1).mean()


def test_bf16_is_the_numpy_forwards_loss_on_the_same_windows(run):
  got = _evaluate(run, "--quant", "bf16")
  model = trained.locate(run)
  _, params = model.load(hf_llama.abstract_params(model.model_cfg))
  data_cfg, _ = evaluate.data_config(model, None, "bytes")
  windows = pipeline.validation_windows(data_cfg, model.tokenizer, seq_len=32, batch_size=8,
                                        num_batches=3)
  losses = [_cross_entropy(numpy_llama(params, w[:, :-1], model.model_cfg), w[:, 1:])
            for w in windows]
  assert got["recipe"] == "bf16" and got["logged_eval_loss"] is None
  np.testing.assert_allclose(got["eval_batch_losses"], losses, rtol=2e-5)
  # MXFP4's forward is another model: its loss is not bf16's.
  assert abs(_evaluate(run)["eval_loss"] - got["eval_loss"]) > 1e-4


def test_an_export_evaluates_as_the_run_does_in_bf16(run, text_glob, tmp_path):
  out = str(tmp_path / "hf")
  export.export(run, out)
  windows = ["--data", text_glob, "--seq_len", "32", "--batches", "2", "--batch_size", "4"]
  from_export = _evaluate(out, *windows)
  from_run = _evaluate(run, *windows, "--quant", "bf16")
  assert from_export["evaluated"] == f"the export {out}" and from_export["recipe"] == "bf16"
  assert from_export["windows"] == dict(batches=2, batch_size=4, seq_len=32)
  assert from_export["eval_batch_losses"] == from_run["eval_batch_losses"]


def _refused(argv, *names):
  rc, out = main_in_process(evaluate.main, argv)
  refused(rc, out, *names)


def test_bad_input_is_one_line_and_exit_2(run, tmp_path):
  _refused([str(tmp_path / "missing")], "does not exist")
  _refused([run, "--step", "3"], "no checkpoint at step 3")
  _refused([run, "--batches", "0"], "--batches 0")
  _refused([run, "--quant", "fp5"], "--quant 'fp5'")
  _refused([run, "--data", str(tmp_path / "none*.txt")], "the validation data", "none*.txt")
  _refused([run, "--data", ""], "--data is empty")
  bare = tmp_path / "bare"
  os.makedirs(bare)
  shutil.copy(os.path.join(run, "config.json"), bare)
  _refused([str(bare)], "has no checkpoint")
  out = str(tmp_path / "hf")
  export.export(run, out)
  _refused([out], "records no validation data", "--data")
  _refused([out, "--step", "2"], "--step 2", "is an export")
