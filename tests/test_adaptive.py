"""config.adaptive_wgrad: the decisions, the switched Wgrad's bits, the monitor, resume, errors."""

import dataclasses
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import traverse_util

import fp4jax
from fp4jax import recipes
from fp4jax.train import adaptive
from fp4jax.llama import model as model_lib
from fp4jax.train import step as train_step
from fp4jax.train import config as train_config
from fp4jax.train import trainer
from fp4jax.train.metrics_log import read_metrics
from tests.helpers import final_state, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = float("nan")


def test_switch_flips_exactly_the_blocks_below_threshold_for_a_window():
  """Threshold 1, window 3, block 2 not eligible (a bf16 block). Known answer:
  block 0 is below on measurements 1-3 (switches at step 30); block 1's run is
  broken by a 2.0 and completes at step 60; block 3 sits at the threshold
  (not below); block 4's runs are broken by a NaN; block 5 is below only twice
  in a row. Saving and loading the state between any two measurements
  changes nothing."""
  series = {0: [0.5, 0.9, 0.1, 0.5, 0.5, 0.5],
            1: [0.5, 0.5, 2.0, 0.5, 0.5, 0.5],
            2: [0.1] * 6,
            3: [1.0] * 6,
            4: [0.5, 0.5, NAN, 0.5, 0.5, NAN],
            5: [0.5, 0.5, 3.0, 0.5, 0.5, 3.0]}
  steps = [10, 20, 30, 40, 50, 60]
  blocks = [0, 1, 3, 4, 5]

  def run(reload_after=None):
    switch = adaptive.WgradSwitch(6, blocks, 1.0, 3)
    decided = {}
    for i, step in enumerate(steps):
      for b in switch.update(step, {b: s[i] for b, s in series.items()}):
        decided[b] = step
      if i == reload_after:
        saved = switch.state_dict()
        switch = adaptive.WgradSwitch(6, blocks, 1.0, 3)
        switch.load_state_dict(saved)
    return decided, switch

  decided, switch = run()
  assert decided == {0: 30, 1: 60}
  assert switch.switched == decided
  np.testing.assert_array_equal(switch.flags(), [True, True, False, False, False, False])
  for i in range(len(steps)):
    assert run(reload_after=i)[0] == decided


def _init_params(model_cfg, tokens_BxL):
  """Parameters of the model (the same for every recipe: the plain one initialises fast)."""
  plain = model_lib.Llama(model_cfg, recipes.recipe("bf16"))
  return nn.unbox(jax.jit(plain.init)(jax.random.key(0), tokens_BxL)["params"])


def test_dot_general_switched_wgrad_is_the_target_bitwise():
  """One GEMM on shapes that need padding, mxfp4-sr (random): the flag True
  gives the target recipe's Wgrad bits, False the FP4 recipe's, Dgrad stays."""
  recipe = recipes.recipe("mxfp4-sr")
  x = jax.random.normal(jax.random.key(0), (40, 72)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (72, 24)).astype(jnp.bfloat16)
  dy = (jax.random.normal(jax.random.key(2), (40, 24)) ** 3).astype(jnp.bfloat16)
  dn, key = (((1,), (0,)), ((), ())), jax.random.key(5)

  def grads(r, to=None, flag=None):
    dot = fp4jax.dot_general(r, to)
    vjp = lambda f: jax.vjp(lambda a, b: dot(a, b, dn, key=key, wgrad_switched=f), x, w)[1](dy)
    return jax.jit(vjp)(flag)

  fp4 = grads(recipe)
  for to in adaptive.TARGETS:
    target = adaptive.target_gemm(to)
    high = grads(dataclasses.replace(recipe, wgrad=target))
    for flag, want in ((True, high), (False, fp4)):
      got = grads(recipe, target, jnp.asarray(flag))
      np.testing.assert_array_equal(got[0], fp4[0])
      np.testing.assert_array_equal(got[1], want[1])
    assert not np.array_equal(high[1], fp4[1])


def test_switch_routes_per_block():
  """Two blocks, mxfp4-sr, one program with the switch: with block 1 switched,
  block 1's seven kernels get the gradients of both switched and block 0 (and
  everything else) those of none switched; both switched equals the model on
  the recipe with the FP8 Wgrad, bitwise; none switched differs from it."""
  model_cfg = model_lib.model_config("tiny", dim=64, n_layers=2, n_heads=2, n_kv_heads=1,
                                     mlp_dim=64, vocab_size=64)
  recipe = recipes.recipe("mxfp4")
  target = adaptive.target_gemm("fp8")
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 64)
  key = jax.random.key(7)
  params = _init_params(model_cfg, tokens)

  def grad_fn(model):
    loss = lambda p, *flags: model.apply({"params": p}, tokens, *flags, rngs={"quant": key}).mean()
    g = jax.jit(jax.grad(loss))
    return lambda *flags: traverse_util.flatten_dict(g(params, *map(jnp.asarray, flags)), sep="/")

  switched = grad_fn(model_lib.Llama(model_cfg, recipe, target))
  none, both, mixed = switched([False, False]), switched([True, True]), switched([False, True])
  high = grad_fn(model_lib.Llama(model_cfg, dataclasses.replace(recipe, wgrad=target)))()
  kernels = [p for p in none if p.startswith("block_1/") and p.endswith("kernel")]
  assert len(kernels) == 7
  for path in none:
    np.testing.assert_array_equal(both[path], high[path], err_msg=path)
    np.testing.assert_array_equal(mixed[path], (both if path in kernels else none)[path],
                                  err_msg=path)
  assert all(not np.array_equal(none[p], both[p]) for p in kernels)


def test_monitor_snr_true_matches_the_model_gradients():
  """Independent reference from the model's own kernel gradients: the signal
  sum <g_a, g_b> over the block's seven kernels, g_a and g_b the exact
  gradients of each sequence of the batch alone; the noise ||g_fp4 - g_exact||
  of the whole batch, FP4 recipe vs the recipe with an unquantized Wgrad
  (float32 everywhere, so the latter is exact). The loss is the mean over
  tokens, so the whole batch's exact gradient is (g_a + g_b) / 2."""
  model_cfg = model_lib.model_config("tiny", dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                                     mlp_dim=64, vocab_size=64, dtype="float32")
  recipe = dataclasses.replace(recipes.recipe("mxfp4"), compute_dtype="float32")
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 64)
  params = _init_params(model_cfg, tokens[:, :-1])

  def kernel_grads(r):
    """Jitted batch -> {path: gradient} of the loss under recipe `r`."""
    g = jax.jit(jax.grad(lambda p, batch: train_step.loss_fn(model_lib.Llama(model_cfg, r), p,
                                                                 batch, jax.random.key(0))))
    return lambda batch: traverse_util.flatten_dict(g(params, batch), sep="/")

  fp4 = kernel_grads(recipe)(tokens)
  exact_one = kernel_grads(dataclasses.replace(recipe, wgrad=recipes.Gemm()))
  g_a, g_b = exact_one(tokens[:1]), exact_one(tokens[1:])  # one compile for both
  exact = {p: (np.asarray(g_a[p], np.float64) + g_b[p]) / 2 for p in g_a}
  want = []
  for b in range(model_cfg.n_layers):
    paths = [p for p in fp4 if p.startswith(f"block_{b}/") and p.endswith("kernel")]
    signal2 = sum(np.sum(np.asarray(g_a[p], np.float64) * np.asarray(g_b[p], np.float64))
                  for p in paths)
    noise = np.sqrt(sum(np.sum((np.asarray(fp4[p], np.float64) - exact[p]) ** 2)
                        for p in paths))
    want.append(np.sqrt(max(signal2, 0.0)) / noise)
  got = adaptive.make_monitor(model_cfg, recipe, (0,), 0)(params, tokens, jax.random.key(3))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3)


def _config(**adaptive_overrides):
  cfg = tiny_config(steps=6, eval_every=6, checkpoint_every=2, **{"quant.name": "mxfp4"})
  cfg.adaptive_wgrad.update(dict(enabled=True, every=1, window=3, to="fp8", **adaptive_overrides))
  return cfg


def _losses(workdir):
  return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


def _assert_same_state(a, b):
  for x, y in zip(jax.tree.leaves(final_state(a)[1]), jax.tree.leaves(final_state(b)[1])):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@pytest.mark.usefixtures("one_device")
def test_trainer_switches_logs_and_resumes_bitwise(tmp_path):
  """Threshold 1e9 (every SNR is below): the one block switches at the third
  measurement (step 3) and computes its Wgrad in FP8 from step 4. Steps 1-3
  (and step 4's loss) equal a run with the switch disabled and later steps differ; a threshold
  that no SNR is below (1e-9) gives the disabled run's bits throughout. A run
  stopped at step 2 (two low measurements so far, in the checkpoint) and
  resumed decides at step 3 too and ends with the same bits."""
  off = str(tmp_path / "off")
  trainer.train(tiny_config(steps=6, eval_every=6, checkpoint_every=2,
                            **{"quant.name": "mxfp4"}), off)
  never = str(tmp_path / "never")
  assert trainer.train(_config(threshold=1e-9), never)["wgrad_switches"] == {}
  assert _losses(never) == _losses(off)
  _assert_same_state(never, off)

  ref = str(tmp_path / "ref")
  assert trainer.train(_config(threshold=1e9), ref)["wgrad_switches"] == {"block_0": 3}
  rows = [r for r in read_metrics(ref) if "loss" in r]
  assert [r.get("wgrad_switch") for r in rows] == [None, None, {"block_0": "fp8"}, None, None, None]
  assert all(r["adaptive_wgrad/block_0/snr_true"] >= 0 for r in rows)
  # Step 4's loss is computed before its (switched) gradient: step 5's is the first to differ.
  assert _losses(ref)[:4] == _losses(off)[:4] and _losses(ref)[4] != _losses(off)[4]

  def terminate(step, state, batch):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)

  work = str(tmp_path / "resumed")
  assert trainer.train(_config(threshold=1e9), work, callbacks=[terminate])["status"] == (
      "interrupted")
  summary = trainer.train(_config(threshold=1e9), work)
  assert summary["resumed_from_step"] == 2 and summary["wgrad_switches"] == {"block_0": 3}
  assert _losses(work) == _losses(ref)
  _assert_same_state(work, ref)


@pytest.mark.parametrize("key,value,match", [
    ("threshold", 0.0, r"adaptive_wgrad.threshold must be > 0 .*got 0.0"),
    ("threshold", NAN, r"adaptive_wgrad.threshold must be > 0 .*got nan"),
    ("window", 0, r"adaptive_wgrad.window must be >= 1, got 0"),
    ("every", -1, r"adaptive_wgrad.every must be >= 1, got -1"),
    ("to", "fp4", r"adaptive_wgrad.to must be one of fp8, bf16, got 'fp4'"),
    ("quant.name", "bf16", r"recipe 'bf16' does not quantize Wgrad"),
    ("model.scan_layers", True, r"adaptive_wgrad needs model.scan_layers=False"),
    ("batch_size", 3, r"adaptive_wgrad needs an even batch_size .*got 3"),
    ("quant.residuals", "quantized", r"adaptive_wgrad needs quant.residuals='original'"),
])
def test_bad_values_are_config_errors(tmp_path, key, value, match):
  cfg = _config()
  if key.startswith(("quant.", "model.")):
    section, field = key.split(".")
    cfg[section][field] = value
  elif key == "batch_size":
    cfg.batch_size = value
  else:
    cfg.adaptive_wgrad[key] = value
  with pytest.raises(train_config.ConfigError, match=match) as error:
    trainer.train(cfg, str(tmp_path))
  assert "\n" not in str(error.value)


@pytest.mark.slow
def test_cli_bad_value_is_one_line_and_exit_2(tmp_path):
  result = subprocess.run(
      [sys.executable, "train.py", "--config=configs/default.py", f"--workdir={tmp_path}",
       "--config.adaptive_wgrad.enabled=True", "--config.adaptive_wgrad.to=fp16"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and "adaptive_wgrad.to must be one of fp8, bf16, got 'fp16'" in lines[0]
