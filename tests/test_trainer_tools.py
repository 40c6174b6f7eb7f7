"""The trainer's tools: model TFLOP/s and MFU, the profiler window, W&B logging.

One short run (profile and, where wandb is installed, W&B offline logging
on) is shared by the tests of the run's outputs.
"""

import glob
import importlib.util
import os
import struct
import types

import jax
import pytest

from fp4jax.train import throughput
from fp4jax.train import trainer
from fp4jax.train.metrics_log import read_metrics
from test_trainer import tiny_config

pytestmark = pytest.mark.slow  # trains (see pyproject's markers)

HAS_WANDB = importlib.util.find_spec("wandb") is not None

# tiny_config's model: dim 64, 1 layer, 2 heads of 32, 1 kv head, mlp 64,
# vocab 288 (the byte tokenizer), seq_len 32. By hand: the layer has
# q 64*64 + k 64*32 + v 64*32 + o 64*64 + gate, up, down 3*64*64 + 2 norms
# 2*64 = 24,704; final norm 64; head 64*288 = 18,432; N = 43,200.
# 6N + 12 L H Q T = 259,200 + 12*1*2*32*32 = 283,776.
TINY_FLOPS_PER_TOKEN = 283_776
TINY_EMBEDDING = 288 * 64


def test_flops_per_token_is_palms_count_by_hand():
  cfg = types.SimpleNamespace(vocab_size=288, dim=64, n_layers=1, n_heads=2)
  n_params = 43_200 + TINY_EMBEDDING
  assert throughput.matmul_params(n_params, cfg) == 43_200
  assert throughput.flops_per_token(n_params, cfg, 32) == TINY_FLOPS_PER_TOKEN


def test_peak_table_lookup_and_override():
  assert throughput.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
  assert throughput.peak_tflops("NVIDIA H200") == 989.0
  assert throughput.peak_tflops("NVIDIA B200") == 2250.0
  assert throughput.peak_tflops("AMD Instinct MI300X") == 1307.4
  assert throughput.peak_tflops("AMD Instinct MI355X") == 2500.0
  assert throughput.peak_tflops("cpu") is None
  assert throughput.peak_tflops("cpu", override=123.0) == 123.0
  assert throughput.peak_tflops("NVIDIA H100", override=500.0) == 500.0
  assert throughput.metrics(1e6, 1e6, 2, peak=None) == {"model_tflops_per_device": 0.5}
  assert throughput.metrics(1e6, 1e6, 2, peak=1.0) == {
      "model_tflops_per_device": 0.5, "mfu": 0.5}


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
  """4 steps with a trace of step 2 (the default start) and, with wandb, W&B offline."""
  workdir = str(tmp_path_factory.mktemp("tools"))
  config = tiny_config(steps=4, eval_every=4, checkpoint_every=4)
  config.profile.update(enabled=True, steps=1)
  config.wandb.update(enabled=HAS_WANDB, project="fp4jax-test")
  old = os.environ.get("WANDB_MODE")
  os.environ["WANDB_MODE"] = "offline"
  try:
    summary = trainer.train(config, workdir)
  finally:
    if old is None:
      os.environ.pop("WANDB_MODE")
    else:
      os.environ["WANDB_MODE"] = old
  return workdir, summary


def test_rows_and_summary_carry_model_tflops_and_no_mfu_on_cpu(tools_run, capsys):
  workdir, summary = tools_run
  rows = [r for r in read_metrics(workdir) if "tokens_per_s" in r]
  assert len(rows) == 4
  for r in rows:
    expected = r["tokens_per_s"] * TINY_FLOPS_PER_TOKEN / jax.device_count() / 1e12
    assert r["model_tflops_per_device"] == pytest.approx(expected, rel=1e-12)
    assert "mfu" not in r
  assert summary["model_tflops_per_device"] == pytest.approx(
      summary["tokens_per_s"] * TINY_FLOPS_PER_TOKEN / jax.device_count() / 1e12, rel=1e-12)
  assert summary["mfu"] is None
  trainer._print_summary(dict(summary, mfu=0.25))  # pylint: disable=protected-access
  out = capsys.readouterr().out
  assert "model TFLOP/s per device" in out and "MFU" in out and "25.0%" in out


def test_the_trace_holds_the_train_step(tools_run):
  workdir, _ = tools_run
  traces = glob.glob(os.path.join(workdir, "tensorboard", "plugins", "profile", "*",
                                  "*.xplane.pb"))
  assert len(traces) == 1
  with open(traces[0], "rb") as f:
    assert b"jit_step" in f.read()


def _wandb_history(run_file):
  """The history rows ({key: json value}) of an offline W&B run file.

  The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of
  records, each with a 7-byte header (crc32, length, kind: 1 full, 2 first,
  3 middle, 4 last) and a piece of a serialized wandb Record.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  with open(run_file, "rb") as f:
    data = f.read()
  rows, piece, pos, block = [], b"", 7, 32768
  while pos + 7 <= len(data):
    if block - pos % block < 7:
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    piece += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(piece)
      piece = b""
      if record.WhichOneof("record_type") == "history":
        rows.append({i.key or "/".join(i.nested_key): i.value_json
                     for i in record.history.item})
  return rows


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install -e '.[wandb]')")
def test_wandb_offline_run_receives_the_metrics_rows(tools_run):
  workdir, _ = tools_run
  run_files = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  assert len(run_files) == 1
  history = _wandb_history(run_files[0])
  rows = read_metrics(workdir)
  assert [int(h["_step"]) for h in history] == [r["step"] for r in rows]
  for h, r in zip(history, rows):
    for key in ("loss", "eval_loss", "model_tflops_per_device"):
      if key in r:
        assert float(h[key]) == pytest.approx(r[key], rel=1e-9)
